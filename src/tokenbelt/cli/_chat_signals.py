"""SIGTERM in ``tokenbelt chat``: end the running turn with ``shutdown``, then leave.

The handler raises ``Terminated`` on the main thread wherever the chat was; a second
SIGTERM exits at once. (Ctrl-C during a remote reply has its own handler, in
``_chat_remote.RemoteTurn``, because the cancel call must come before the hang-up.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
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
