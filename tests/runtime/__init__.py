"""Tests of the runtime (the SDK), plus the few helpers they share.

``Recorder`` is a trace observer: it keeps every lifecycle event of every request in
the order it arrived, with the request's tokens computed (``completion_tokens``) at
that moment, so a test can tell how many tokens were computed after a cancel. The
waits below poll a condition under a safety net; the net is never the assertion.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenbelt import EndReason, TraceEvent

#: a safety net for waits and joins, never the assertion itself
NET = 30.0

#: every timestamp of a request that was admitted, produced and then stopped
TIMELINE = ("enqueued", "admitted", "first_token", "last_token", "cancel_requested", "released")


@dataclass(frozen=True)
class Seen:
    """One lifecycle event as an observer saw it."""

    kind: str
    request_id: str
    at: float
    #: tokens the request had computed when the event fired
    completion_tokens: int
    #: the request's end reason when the event fired
    end_reason: EndReason | None


class Recorder:
    """A thread-safe trace observer that remembers every event, in arrival order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.seen: list[Seen] = []

    def __call__(self, event: TraceEvent) -> None:
        trace = event.trace
        seen = Seen(
            event.kind, trace.request_id, event.at, trace.completion_tokens, trace.end_reason
        )
        with self._cond:
            self.seen.append(seen)
            self._cond.notify_all()

    def of(self, request_id: str) -> list[Seen]:
        with self._cond:
            return [s for s in self.seen if s.request_id == request_id]

    def kinds(self, request_id: str) -> list[str]:
        return [s.kind for s in self.of(request_id)]

    def of_kind(self, kind: str) -> list[Seen]:
        with self._cond:
            return [s for s in self.seen if s.kind == kind]

    def wait(self, request_id: str, kind: str, timeout: float = NET) -> Seen:
        """Block until ``request_id`` emitted ``kind``; fails after ``timeout``."""

        def find() -> Seen | None:
            return next(
                (s for s in self.seen if s.request_id == request_id and s.kind == kind), None
            )

        with self._cond:
            found = self._cond.wait_for(find, timeout)
        assert found is not None, f"{request_id} emitted no {kind!r} within {timeout} s"
        return found


def wait_until(condition: Callable[[], bool], what: str, timeout: float = NET) -> None:
    """Poll ``condition`` until it holds; fails with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout} s"
        time.sleep(0.002)


async def await_until(condition: Callable[[], bool], what: str, timeout: float = NET) -> None:
    """``wait_until`` for a coroutine: the event loop keeps running meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout} s"
        await asyncio.sleep(0.002)


def words(n: int) -> list[str]:
    """``n`` scripted pieces: `` w0``, `` w1``, ..."""
    return [f" w{i}" for i in range(n)]
