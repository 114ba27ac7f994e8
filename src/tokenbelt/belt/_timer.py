"""One deadline timer per runtime: deadlines fire whether or not anyone reads.

A heap of (when, belt) entries served by one thread, as trio keeps its cancel
scopes' deadlines in one heap in the run loop. Entries are lazy: a belt whose
deadline moved later (the stall clock restarted) is simply looked at again when
its old entry comes up, and asks to be scheduled for its new time; an ended belt
is dropped. Belts are held weakly, so an entry never keeps a request alive.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger("tokenbelt.deadlines")

#: seconds the timer's loop waits before it starts again after a failure (no spinning)
_RESTART_PAUSE_S = 0.05


class Expirable(Protocol):
    """What the timer needs of a belt: end it if a deadline passed, else say when to look."""

    def expire(self) -> float | None:
        """End on an expired deadline; the next deadline's monotonic time, or None."""


class DeadlineTimer:
    """Fires each scheduled belt's deadlines at their time, on one daemon thread.

    ``schedule`` is thread-safe and never blocks on a belt. The thread runs from
    construction to ``close()``.
    """

    def __init__(
        self, *, name: str = "tokenbelt-deadlines", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, weakref.ref[Expirable]]] = []
        self._ids = itertools.count()
        self._closed = False
        #: expiries that raised (logged; the thread went on)
        self.failures = 0
        #: times the thread's own loop failed (logged; it started again)
        self.restarts = 0
        # Started now, not with the first deadline: the thread's life is the owner's
        # (a runtime), from construction to ``close()``.
        self._thread: threading.Thread | None = threading.Thread(
            target=self._keep_running, name=name, daemon=True
        )
        self._thread.start()

    def schedule(self, belt: Expirable, when: float) -> None:
        """Look at ``belt`` at monotonic time ``when`` (it cancels itself if expired)."""
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (when, next(self._ids), weakref.ref(belt)))
            if self._heap[0][0] == when:
                self._cond.notify()

    def _keep_running(self) -> None:
        """The thread: ``_run`` until ``close()``. A failure of the loop itself (the clock,
        a wait) is logged, counted (``restarts``) and the loop started again after a short
        pause, its heap intact: every deadline of the runtime waits on this one thread."""
        while True:
            try:
                self._run()
                return
            except Exception:
                self.restarts += 1
                logger.exception("the deadline timer failed; it starts again")
                with self._cond:
                    if self._cond.wait_for(lambda: self._closed, _RESTART_PAUSE_S):
                        return

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._heap:
                    self._cond.wait()
                if self._closed:
                    return
                when, _, ref = self._heap[0]
                remaining = when - self._clock()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                heapq.heappop(self._heap)
            belt = ref()
            if belt is None:
                continue
            try:
                later = belt.expire()
            except Exception:
                # A cancel callback that fails must not end the thread every other
                # deadline of the runtime waits on: say so, and go on.
                self.failures += 1
                logger.exception("a deadline's cancel failed; the deadline timer goes on")
                continue
            if later is not None:
                self.schedule(belt, later)

    def close(self) -> None:
        """Stop the thread; pending deadlines are dropped (their belts end otherwise)."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
