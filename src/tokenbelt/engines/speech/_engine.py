"""``SpeechEngine``: a Whisper model (faster-whisper) in a worker process of its own.

The engine contract's loop shape with one slot: ``start`` hands a transcription to the
worker and returns; the parent's reader thread puts each ``Segment`` the worker sends on
the request's belt (waiting for room: backpressure), and then lets the worker go on
(``go``). A cancel from any boundary (the belt's ``on_cancel``) is sent at once; the
worker stops before its next native call (``_child``: at most one window's encode or
decode), answers ``ended``, and only then is the request released: the trace's
``cancel_to_release`` is the real busy-after-stop. A worker that does not answer a stop
within ``stop_grace`` seconds is killed (``trace.worker.killed``), and one that dies
fails its request (``WorkerCrashed``) and is started again for the next.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..._errors import (
    Cancelled,
    IllegalState,
    InvalidArgument,
    LoadTimeout,
    ModelLoadError,
    WorkerCrashed,
)
from ...belt import EndReason, Producer
from .._base import OnExit, check_can_start
from .._statistics import EngineStatistics
from ..llama import usable_cores
from ._request import SpeechInfo, TranscriptionRequest

logger = logging.getLogger("tokenbelt.engines.speech")

#: the folder that holds the ``tokenbelt`` package
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
#: the worker's module, run with ``python -m``
CHILD_MODULE = "tokenbelt.engines.speech._child"

#: a worker that has not answered a stop this long after it is killed
DEFAULT_SPEECH_STOP_GRACE = 30.0


@dataclass(frozen=True, slots=True)
class SpeechConfig:
    """How a speech model runs: its name, threads (0: every usable core) and the stop's
    grace before the worker is killed."""

    name: str = "whisper"
    threads: int = 0
    stop_grace: float = DEFAULT_SPEECH_STOP_GRACE
    #: the languages it transcribes (an English-only model: ``("en",)``)
    languages: tuple[str, ...] = ("en",)
    translates: bool = False


class _Running:
    """The one request the worker serves now."""

    def __init__(self, job: int, producer: Producer[Any], on_exit: OnExit | None) -> None:
        self.job = job
        self.producer = producer
        self.on_exit = on_exit
        self.done = False
        #: the request, while it waits for a worker that is starting again
        self.pending: TranscriptionRequest | None = None
        #: the stop grace's timer, armed by a cancel, disarmed by the release
        self.grace: threading.Timer | None = None


class SpeechEngine:
    """A speech model in a worker process; one request at a time (``slots == 1``)."""

    slots = 1
    context_length = 0
    template_tools = False
    tool_format = "tokenbelt"
    reasoning = None

    def __init__(self, path: Path, config: SpeechConfig, *, load_timeout: float | None) -> None:
        self.path = Path(path)
        self.config = config
        self.name = config.name
        self._threads = config.threads or usable_cores()
        self._load_timeout = load_timeout
        self._lock = threading.Lock()
        # One sender at a time: a cancel (any thread) and a go (the relay) share the pipe.
        self._send_lock = threading.Lock()
        self._running: _Running | None = None
        self._jobs = 0
        self._served = 0
        self._restarts = 0
        self._closed = False
        #: why a worker was killed, by its pid (a late stop)
        self._killed: dict[int, str] = {}
        self._conn: Connection | None = None
        self._process: Any = None
        self._spawn()

    @classmethod
    def load(
        cls, path: Path, config: SpeechConfig, *, load_timeout: float | None = None
    ) -> SpeechEngine:
        """Start the worker and load ``path`` there (blocking, at most ``load_timeout``
        seconds: ``LoadTimeout``); ``ModelLoadError`` for a folder it cannot load."""
        return cls(path, config, load_timeout=load_timeout)

    # -- the worker ----------------------------------------------------------------------

    def _spawn(self) -> None:
        # A fresh interpreter (never a fork), as the chat worker: python -m _child FD.
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    CHILD_MODULE,
                    str(theirs.fileno()),
                    str(self.path),
                    str(self._threads),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except OSError as exc:
            ours.close()
            raise ModelLoadError(f"could not start a speech worker: {exc}") from exc
        finally:
            theirs.close()
        parent = Connection(ours.detach())
        deadline = None if self._load_timeout is None else time.monotonic() + self._load_timeout
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not parent.poll(left):
            process.kill()
            process.wait(5)
            raise LoadTimeout(
                f"speech model {self.name} did not load within {self._load_timeout:g} s"
            )
        try:
            msg = parent.recv()
        except EOFError:
            msg = ("failed_load", f"the worker exited with code {process.wait(5)}")
        if msg[0] != "ready":
            process.wait(5)
            raise ModelLoadError(f"speech model {self.name} ({self.path}): {msg[1]}")
        self._info = msg[1]
        # Under the send lock: a request that waited for this worker is sent its start
        # before anything else (its cancel, if one comes now, follows it).
        with self._send_lock:
            with self._lock:
                self._conn, self._process = parent, process
                running = self._running
                pending = running.pending if running is not None else None
                if running is not None:
                    running.pending = None
            if running is not None and pending is not None:
                running.producer.trace.worker = {"pid": process.pid}
                parent.send(("start", running.job, pending))
        threading.Thread(
            target=self._read, args=(parent, process), name="tokenbelt-speech-relay", daemon=True
        ).start()

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            conn = self._conn
        if conn is None:
            return
        try:
            with self._send_lock:
                conn.send(msg)
        except (OSError, ValueError):  # the worker is gone: its reader fails the request
            pass

    def _read(self, conn: Connection, process: Any) -> None:
        """The parent's one reader of the worker's pipe, until the worker ends."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                running = self._running
            if running is None or msg[1] != running.job:
                continue  # a late answer for a request already released
            if msg[0] == "segment":
                self._put(running, msg[2])
            elif msg[0] == "ended":
                if msg[2] == "stop":
                    running.producer.finish(EndReason.STOP)
                self._release(running)
            elif msg[0] == "failed":
                running.producer.fail(WorkerCrashed(f"speech worker failed: {msg[2]}"))
                self._release(running)
        self._on_worker_end(process)

    def _put(self, running: _Running, segment: Any) -> None:
        producer = running.producer
        try:
            producer.put(segment)  # waits for room; raises once cancelled
        except Cancelled:  # on_cancel sent the cancel; the worker answers "ended"
            return
        producer.count_token()
        self._send(("go", running.job))

    def _release(self, running: _Running) -> None:
        with self._lock:
            if running.done:
                return
            running.done = True
            if self._running is running:
                self._running = None
            self._served += 1
            if running.grace is not None:
                running.grace.cancel()
        try:
            if running.on_exit is not None:
                running.on_exit()
        finally:
            running.producer.release()

    def _on_worker_end(self, process: Any) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)
        with self._lock:
            running, closed = self._running, self._closed
            self._conn = None
        if running is not None and not running.done:
            why = self._killed.pop(process.pid, None)
            running.producer.trace.worker = {"pid": process.pid, "killed": why}
            running.producer.fail(
                WorkerCrashed(f"speech worker exited with code {process.returncode}")
            )
            self._release(running)
        if closed:
            return
        logger.warning(
            "speech worker %s ended (code %s); starting it again", process.pid, process.returncode
        )
        try:
            self._restarts += 1
            self._spawn()
        except Exception as exc:
            logger.exception("speech worker %s could not be started again", self.name)
            with self._lock:
                waiting = self._running
            if waiting is not None and waiting.pending is not None:
                waiting.producer.fail(WorkerCrashed(f"the speech worker did not restart: {exc}"))
                self._release(waiting)

    def _kill_if_late(self, running: _Running, process: Any) -> None:
        if running.done or self._process is not process:
            return
        logger.warning(
            "speech worker %s did not stop within %g s: killing it",
            process.pid,
            self.config.stop_grace,
        )
        self._killed[process.pid] = f"no stop within {self.config.stop_grace:g} s"
        process.kill()

    # -- the contract --------------------------------------------------------------------

    def speech_info(self) -> SpeechInfo:
        return SpeechInfo(
            name=self.name,
            languages=self.config.languages,
            translates=self.config.translates,
            details={"threads": self._threads, "path": str(self.path)},
        )

    def count_prompt_tokens(self, request: Any) -> int:
        """A transcription has no prompt to count (its prompt text is Whisper's own);
        anything else (a chat) is refused before it queues (``InvalidArgument``)."""
        if not isinstance(request, TranscriptionRequest):
            raise InvalidArgument(
                f"model {self.name} is a speech model: it transcribes audio "
                "(/v1/audio/transcriptions, Model.transcribe) and does not chat",
                param="model",
            )
        return 0

    def start(self, request: Any, producer: Producer[Any], on_exit: OnExit | None = None) -> None:
        """Send ``request`` to the worker (or, while a crashed worker starts again, to
        the new one once it is ready); never blocks. ``IllegalState`` when closed, busy,
        or not a ``TranscriptionRequest``."""
        if not isinstance(request, TranscriptionRequest):
            raise IllegalState(
                f"a speech engine serves transcriptions, not {type(request).__name__}"
            )
        with self._lock:
            check_can_start(self._closed, 0 if self._running is None else 1, 1, "speech slots")
            self._jobs += 1
            running = _Running(self._jobs, producer, on_exit)
            self._running = running
            process = self._process
            # A worker starting again after a crash: the request waits for it (``_spawn``).
            waiting = self._conn is None
            if waiting:
                running.pending = request
        producer.start()
        producer.trace.worker = {"pid": process.pid}

        def cancelled(reason: EndReason) -> None:
            with self._lock:
                unsent = running.pending is not None
                running.pending = None
            if unsent:  # never reached a worker: nothing to stop
                self._release(running)
                return
            self._send(("cancel", running.job))
            with self._lock:
                if running.done:  # released already: nothing to watch
                    return
                timer = threading.Timer(
                    self.config.stop_grace, self._kill_if_late, args=(running, process)
                )
                timer.daemon = True
                timer.name = f"tokenbelt-speech-grace-{running.job}"
                running.grace = timer
                timer.start()

        # Sent before the cancel hook: a request cancelled already is sent its cancel after.
        if not waiting:
            self._send(("start", running.job, request))
        producer.on_cancel(cancelled)

    def statistics(self) -> EngineStatistics:
        with self._lock:
            running = 0 if self._running is None else 1
        return EngineStatistics(slots=1, running=running)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running, process = self._running, self._process
        if running is not None:
            running.producer.cancel(EndReason.SHUTDOWN)
        self._send(("close",))
        if process is not None:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
