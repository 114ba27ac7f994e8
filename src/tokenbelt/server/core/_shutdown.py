"""A shutdown that stops work: uvicorn's server with tokenbelt's signal handling.

uvicorn's own first SIGINT or SIGTERM closes the listener and then waits for every
connection to finish, so running streams kept generating until their end and a
queued request waited its turn. Here the first signal, before uvicorn waits for
anything:

1. stops admitting (a request that arrives now is answered 503 with ``Retry-After``);
2. ends every queued and running request with ``shutdown``: each stream gets its
   final chunk and ``[DONE]``, each non-streaming client a 503 in its API's shape;
3. waits up to ``grace`` seconds for the engines to release them;
4. lets uvicorn close the connections (what is left of ``grace``), unload the
   models (the app's lifespan closes the runtime) and return; the process exits 0.

Each phase is one log line. A second signal exits at once, with status 128 + the
signal's number and no traceback.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import threading
import time
from types import FrameType

import uvicorn

from ...runtime import Runtime
from ._state import ServerState

logger = logging.getLogger("tokenbelt.server")

#: seconds a shutdown waits for releases and connections unless told otherwise
DEFAULT_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose first signal ends every request with ``shutdown``."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, *, grace: float = DEFAULT_GRACE_S
    ) -> None:
        super().__init__(config)
        self.state = state
        self.grace = grace
        self._signalled: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler (on the main thread, between two bytecodes of the loop)."""
        if self._signalled is not None:
            # Not through logging: its lock may be held by the code this interrupted.
            os.write(2, f"tokenbelt: {_name(sig)} again: exiting now\n".encode())
            os._exit(128 + sig)
        self._signalled = sig
        # Not appended to uvicorn's captured signals: uvicorn would raise the signal
        # again once it returns, and the process would die of it instead of exiting 0.
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self.begin_shutdown, _name(sig))

    def begin_shutdown(self, why: str = "shutdown requested") -> None:
        """Start the shutdown (on the event loop); ``should_exit`` follows the drain."""
        if self.state.shutting_down:
            return
        self.state.shutting_down = True
        runtime = self.state.runtime
        running = queued = 0
        for model in runtime.models.values():
            stats = model.statistics()
            running, queued = running + stats.running, queued + stats.queued
        logger.info(
            "shutdown (%s): refusing new requests; ending %d running and %d queued "
            "with shutdown; grace %g s",
            why,
            running,
            queued,
            self.grace,
        )
        threading.Thread(
            target=self._drain, args=(runtime,), name="tokenbelt-shutdown", daemon=True
        ).start()

    def _drain(self, runtime: Runtime) -> None:
        started = time.monotonic()
        released = runtime.drain(self.grace)
        took = time.monotonic() - started
        if released:
            logger.info("shutdown: every request released in %.2f s", took)
        else:
            logger.warning("shutdown: requests still held after the %g s grace", self.grace)
        # Whole seconds (uvicorn's type), at least one: a final chunk needs a moment.
        left = max(1, math.ceil(self.grace - took))
        # uvicorn reads it when it starts waiting for the connections, after should_exit.
        self.config.timeout_graceful_shutdown = left
        logger.info("shutdown: closing connections (at most %d s), then unloading", left)
        self.should_exit = True


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
