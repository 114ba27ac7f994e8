"""Slots and the bounded FIFO admission queue of one model.

A slot serves one request at a time. Every engine has the loop shape
(``engines.LoopEngine``): it brings ``engine.slots`` slots and runs every request it
is given with ``start`` in its own loop (a batch engine in one llama.cpp context; an
engine whose work blocks, on a producer thread per request). A request that finds no
free slot waits in the queue; a full queue rejects at once. A queued request that is
cancelled, or whose deadline passes (the runtime's deadline timer fires it, reader or
not), leaves the queue at once and is released.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._errors import QueueFull, RuntimeClosed
from ..belt import Belt, EndReason, check_capacity
from ..engines import Engine, GenerationRequest

logger = logging.getLogger("tokenbelt.runtime")


@dataclass(frozen=True)
class SchedulerStatistics:
    """A snapshot: slots in use, requests waiting, and the queue's peak and size."""

    slots: int
    running: int
    queued: int
    queue_size: int
    queue_peak: int


class _Job:
    __slots__ = ("belt", "request")

    def __init__(self, request: GenerationRequest, belt: Belt[str]) -> None:
        self.request = request
        self.belt = belt


class Scheduler:
    """Hands requests to free slots in FIFO order; thread-safe."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        queue_size: int = 16,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a scheduler needs at least one engine")
        self.engines = list(engines)
        self.queue_size = check_capacity(queue_size, name="queue_size")
        self._on_idle = on_idle
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # One entry per slot: a batch engine appears once for each of its sequences.
        self._free: list[Engine] = [e for e in engines for _ in range(max(1, e.slots))]
        self.slots = len(self._free)
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: dict[int, _Job] = {}
        self._queue_peak = 0
        self._closed = False
        # A request whose belt ended before the engine took it (a supersede, a deadline
        # of a millisecond) exits inside ``engine.start``, on the starting thread, which
        # holds the lock: its exit waits in this thread's list until the lock is let go.
        self._starting = threading.local()

    def statistics(self) -> SchedulerStatistics:
        with self._lock:
            return SchedulerStatistics(
                slots=self.slots,
                running=len(self._running),
                queued=len(self._queue),
                queue_size=self.queue_size,
                queue_peak=self._queue_peak,
            )

    def submit(self, request: GenerationRequest, belt: Belt[str]) -> None:
        """Start ``request`` on a free slot, or queue it; never blocks on generation.

        Raises ``QueueFull`` (the belt ends ``rejected`` and is released) when the
        queue is full, and ``RuntimeClosed`` after ``close()``.
        """
        job = _Job(request, belt)
        belt.trace.mark_enqueued()
        with self._lock:
            if self._closed:
                raise RuntimeClosed("the model is closed")
            started = bool(self._free)
            rejected = False
            if started:
                self._start_locked(job, self._free.pop())
            elif len(self._queue) >= self.queue_size:
                rejected = True
            else:
                self._queue.append(job)
                self._queue_peak = max(self._queue_peak, len(self._queue))
        if started:
            self._exit_deferred()
            return
        if rejected:
            belt.cancel(EndReason.REJECTED)
            belt.release()
            raise QueueFull(
                f"the admission queue is full ({self.queue_size} waiting); try again later"
            )
        belt.on_cancel(lambda _reason: self._leave_queue(job))

    def _leave_queue(self, job: _Job) -> None:
        with self._lock:
            try:
                self._queue.remove(job)
            except ValueError:
                # Admitted (the producer sees the cancel itself), or taken off by
                # _finished, which releases it.
                return
        job.belt.release()

    def _start_locked(self, job: _Job, engine: Engine) -> None:
        self._running[id(job)] = job
        # The engine's loop admits the request; never blocks.
        self._starting.inside = True
        try:
            engine.start(job.request, job.belt.producer, lambda: self._exit(job, engine))
        finally:
            self._starting.inside = False

    def _exit(self, job: _Job, engine: Engine) -> None:
        if getattr(self._starting, "inside", False):
            # Under the lock, in ``_start_locked``: handed on once it is let go.
            self._starting.__dict__.setdefault("exits", []).append((job, engine))
            return
        self._finished(job, engine)

    def _exit_deferred(self) -> None:
        """Hand on the slots of the requests that ended while this thread started them."""
        exits = getattr(self._starting, "exits", None)
        while exits:
            self._finished(*exits.pop())

    def _finished(self, job: _Job, engine: Engine) -> None:
        """On the producer thread, after the engine let go: hand the slot on."""
        idle = False
        ended: list[_Job] = []
        with self._lock:
            self._running.pop(id(job), None)
            while self._queue and not self._closed:
                nxt = self._queue.popleft()
                if nxt.belt.end_reason is None:
                    self._start_locked(nxt, engine)
                    break
                # Cancelled, but its cancel callback has not taken it out yet: once it
                # runs it finds the job gone and leaves the release to us.
                ended.append(nxt)
            else:
                self._free.append(engine)
            idle = not self._running and not self._queue
            self._idle.notify_all()
        for skipped in ended:
            skipped.belt.release()
        self._exit_deferred()
        if idle and self._on_idle is not None:
            self._on_idle()

    def cancel_all(self, reason: EndReason) -> None:
        """Cancel every queued and running request with ``reason``."""
        with self._lock:
            jobs = list(self._queue) + list(self._running.values())
        for job in jobs:
            job.belt.cancel(reason)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request runs or waits; False if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._running and not self._queue, timeout)

    def drain(self) -> None:
        """Refuse new requests and cancel every queued and running one with ``shutdown``.

        Never blocks: ``wait_idle`` waits for their release.
        """
        with self._lock:
            self._closed = True
        self.cancel_all(EndReason.SHUTDOWN)

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests, cancel the rest with ``shutdown``, wait for every release."""
        self.drain()
        if not self.wait_idle(timeout):
            logger.warning("requests still running %s s after shutdown", timeout)
