"""One worker process and its pipe: the plumbing under ``WorkerEngine``.

``spawn`` starts a worker (a fresh interpreter running ``_child.py``, never a fork) and
sends it the model to load. ``Process`` holds the child, its socket and what waits to be
written to it; it frames the messages of ``_messages.py`` and never blocks its caller
(a start, a credit, a stop are posted under a belt's lock); it reads what the worker
sends until the pipe ends. ``describe_exit`` names how a worker ended.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..._errors import LoadTimeout, ModelLoadError
from ._messages import Close, Load, ToParent, ToWorker, frame, input_waiter, messages

logger = logging.getLogger("tokenbelt.engines.worker")

#: seconds to wait for a worker to exit (after its pipe ended, or after ``Close``)
EXIT_WAIT_S = 10.0
#: the folder that holds the ``tokenbelt`` package
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
#: the worker's module, run with ``python -m``
CHILD_MODULE = "tokenbelt.engines.worker._child"


def describe_exit(code: int) -> str:
    """Name a worker's end: a signal (negative return code) or an exit code."""
    if code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:  # pragma: no cover - a signal Python has no name for
            name = ""
        return f"engine worker killed by signal {-code}{name}"
    return f"engine worker exited with code {code}"


class Process:
    """One worker process, its pipe and what waits to be sent on it.

    ``post`` writes a message to the pipe on the caller's thread when nothing waits
    before it and the pipe takes it whole without blocking (the common case: a start,
    a credit, a stop are small); what the pipe does not take waits in the outbox for
    the sender thread, so a caller never blocks and the order holds.
    """

    def __init__(self, popen: subprocess.Popen[bytes], sock: socket.socket, number: int) -> None:
        self.popen = popen
        self.sock = sock
        # The reader's end: a copy of the descriptor, read with Connection's framing.
        self.conn = Connection(os.dup(sock.fileno()))
        self.number = number
        self.pid = popen.pid
        self.cond = threading.Condition()
        #: frames (bytes) to write, and work (a credit to work out) for the sender to run
        self.outbox: collections.deque[bytes | Callable[[], None]] = collections.deque()
        #: the sender thread is writing a frame it took from the outbox
        self.writing = False
        self.done = False
        self.ready = threading.Event()
        self.became_ready = False
        self.load_error: str | None = None
        self.info: dict[str, Any] = {}
        #: why the parent killed it, when it did
        self.cause: str | None = None
        self.load_by: float | None = None
        #: killed for taking longer than the load timeout
        self.load_expired = False
        #: when its engine last answered a heartbeat (or became ready), monotonic
        self.answered_at: float | None = None

    def post(self, message: ToWorker) -> None:
        """Send a message, or queue it for the sender thread; never blocks (safe under a
        belt's lock)."""
        with self.cond:
            if self.done:
                return
            if self.outbox or self.writing:
                self.outbox.append(frame(message))
                self.cond.notify()
                return
            data = frame(message)
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:
                return  # the worker is gone: the reader thread ends its requests
            if sent < len(data):
                self.outbox.append(data[sent:])
                self.cond.notify()

    def defer(self, work: Callable[[], None]) -> None:
        """Queue ``work`` for the sender thread, after what waits before it; never blocks
        (a read that made room asks the sender to work out the credit)."""
        with self.cond:
            if self.done:
                return
            self.outbox.append(work)
            self.cond.notify()

    def send_queued(self) -> None:
        """The sender thread: write what ``post`` queued, in order, and run the work
        ``defer`` queued, until ``done``. May block on the pipe."""
        while True:
            with self.cond:
                while not self.outbox and not self.done:
                    self.cond.wait()
                if not self.outbox:
                    return
                item = self.outbox.popleft()
                self.writing = isinstance(item, bytes)
            if not isinstance(item, bytes):  # a read made room: work out the credit
                item()
                continue
            try:
                self.sock.sendall(item)
            except OSError:
                return  # the worker is gone: the reader thread ends its requests
            finally:
                with self.cond:
                    self.writing = False

    def close_pipe(self) -> None:
        self.conn.close()
        self.sock.close()

    def stop(self) -> None:
        """Ask the worker to exit and wait; kill it if it does not."""
        self.post(Close())
        try:
            self.popen.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine worker %s did not exit; killing it", self.pid)
            self.kill("engine worker killed: it did not exit when closed")

    def kill(self, cause: str) -> None:
        if self.cause is None:
            self.cause = cause
        with contextlib.suppress(ProcessLookupError):  # it died meanwhile
            self.popen.send_signal(signal.SIGKILL)

    def rss(self) -> int | None:
        import psutil

        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except (psutil.Error, OSError):
            return None

    def wait_ready(self, timeout: float | None, what: str) -> None:
        """Wait for this worker to be ready; raise why it is not (``LoadTimeout``,
        ``ModelLoadError``). ``what`` names the model file in the error."""
        if not self.ready.wait(timeout):
            self.kill("the load timed out")
            raise LoadTimeout(f"loading {what} took longer than {timeout} s")
        if self.load_error is not None:
            raise ModelLoadError(self.load_error)
        if self.load_expired:
            # The supervisor killed it for the same deadline a moment before this wait ended.
            raise LoadTimeout(f"loading {what} took longer than {timeout} s")
        if not self.became_ready:
            raise ModelLoadError(f"{self.cause or 'the engine worker died'} while loading {what}")

    def read(self, handle: Callable[[ToParent], None]) -> int:
        """The reader thread: hand each message to ``handle`` until the pipe ends, then
        wait for the process to exit and close the pipe; returns its exit code. A message
        that cannot be read or applied kills the worker."""
        # Not woken each time the worker takes a credit written here (``input_waiter``).
        wait = input_waiter(self.conn)
        try:
            while True:
                try:
                    wait()
                    received = messages(self.conn.recv())
                except (EOFError, OSError):
                    break
                except Exception as exc:  # an item that does not unpickle here
                    logger.error("engine worker %s sent what cannot be read: %s", self.pid, exc)
                    self.kill(f"engine worker sent a message that could not be read: {exc}")
                    break
                if not self._apply(handle, received):
                    break
        finally:
            try:
                code = self.popen.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:  # it closed its pipe but does not exit
                self.kill("engine worker killed: it closed its pipe but did not exit")
                code = self.popen.wait()
            self.close_pipe()
        return code

    def _apply(self, handle: Callable[[ToParent], None], received: list[ToParent]) -> bool:
        """Hand a frame's messages to ``handle`` in order; False (and the worker killed)
        when one makes no sense here."""
        for message in received:
            try:
                handle(message)
            except Exception as exc:
                logger.exception("engine worker %s: cannot apply %r", self.pid, message)
                self.kill(f"engine worker killed: it sent a message that failed here: {exc}")
                return False
        return True


def spawn(number: int, load: Load) -> Process:
    """Start worker ``number`` and send it ``load``; does not wait for it to load.
    Raises ``ModelLoadError`` when no process can be started."""
    ours, theirs = socket.socketpair()
    # The worker imports the tokenbelt this process runs, wherever it came from.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except OSError as exc:
        ours.close()
        raise ModelLoadError(f"could not start an engine worker: {exc}") from exc
    finally:
        theirs.close()
    w = Process(popen, ours, number)
    w.post(load)
    return w
