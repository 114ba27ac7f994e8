"""Signals in ``tokenbelt chat``: SIGTERM ends the running turn with ``shutdown``, then
leaves; a Ctrl-C at the prompt is never lost (``PromptInterrupts``).

The handler raises ``Terminated`` on the main thread wherever the chat was; a second
SIGTERM exits at once. (Ctrl-C during a remote reply has its own handler, in
``_chat_remote.RemoteTurn``, because the cancel call must come before the hang-up.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

from ._chat_backend import Backend
from ._chat_local import LocalBackend


class Terminated(BaseException):
    """Raised on the main thread by SIGTERM, wherever the chat was (a BaseException, as
    ``KeyboardInterrupt``: no ``except Exception`` on the way may swallow it)."""


def on_terminate(backend: Backend) -> Callable[[int, FrameType | None], None]:
    """SIGTERM: end the running turn with ``shutdown`` and leave; a second one exits now."""
    terminating = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal terminating
        if terminating:
            os._exit(128 + signum)
        terminating = True
        if isinstance(backend, LocalBackend):
            # Ends every request with shutdown before the exception unwinds the reader,
            # whose own stop (user_cancel) then comes second and is ignored. On its own
            # thread: this handler may have interrupted code that holds a lock it needs.
            drain = threading.Thread(target=backend.runtime.drain, args=(0,), daemon=True)
            drain.start()
            drain.join(1.0)
        raise Terminated

    return handler


class PromptInterrupts:
    """Ctrl-C (SIGINT) at the prompt is never lost.

    CPython's readline draws the prompt, then waits in ``select()`` on the terminal; a
    SIGINT that lands between the two (or on another thread) only trips Python's flag,
    and the wait goes on until the next key: the chat ignored that Ctrl-C. (Measured with
    two busy threads beside ``input()``: 109 of 200 Ctrl-Cs pressed as the prompt appeared
    were lost.) Python writes every caught signal to its wakeup fd; a watcher thread reads
    it and, when a SIGINT came during a prompt and no handler has run during that prompt
    within ``GRACE_S``, sends the signal again to the main thread, whose ``select()`` then
    wakes.

    ``install()`` sets the SIGINT handler and the wakeup fd; ``close()`` puts both back.
    Use ``prompting()`` around ``input()``.
    """

    GRACE_S = 0.1

    def __init__(self) -> None:
        self._prompt = 0  # which prompt is showing (0: none)
        self._prompts = 0
        self._handled_in = 0  # the prompt during which a SIGINT handler last ran
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._saved_fd: int | None = None
        self._saved_handler: object = None

    def install(self) -> None:
        self._saved_handler = signal.signal(signal.SIGINT, self._interrupt)
        if not hasattr(signal, "pthread_kill"):  # not POSIX: Python's own handling only
            return
        self._saved_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="tokenbelt-ctrl-c", daemon=True).start()

    def close(self) -> None:
        signal.signal(signal.SIGINT, self._saved_handler)  # type: ignore[arg-type]
        if self._saved_fd is not None:
            signal.set_wakeup_fd(self._saved_fd)
        os.close(self._write)  # the watcher's read ends

    @contextlib.contextmanager
    def prompting(self) -> Iterator[None]:
        self._prompts += 1
        self._prompt = self._prompts
        try:
            yield
        finally:
            self._prompt = 0

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        self._handled_in = self._prompt
        raise KeyboardInterrupt

    def _watch(self) -> None:
        main = threading.main_thread().ident or 0
        while True:
            try:
                caught = os.read(self._read, 64)
            except OSError:
                return
            if not caught:
                os.close(self._read)
                return
            prompt = self._prompt
            if signal.SIGINT not in caught or not prompt:
                continue
            time.sleep(self.GRACE_S)
            # Still the same prompt and no handler ran during it: the signal was lost. (A
            # time test missed the Ctrl-C pressed as the next prompt appeared, within a
            # few ms of the last one's handler: 1 in 30 in a loaded test run.)
            if self._prompt == prompt and self._handled_in != prompt:
                signal.pthread_kill(main, signal.SIGINT)
