"""The belt: a bounded, cancellable channel from one producer to one consumer.

The producer is a plain thread (the decode loop) or a coroutine; the consumer is
sync or async. Either side may be on any thread. One ``threading.Lock`` guards
the state; sync waiters sleep on a ``threading.Condition`` and async waiters on a
future woken with ``call_soon_threadsafe``.

Producer protocol, once per token::

    belt.wait_for_room()    # blocks while the belt is full: no compute is spent ahead
    token = compute()       # the engine also calls belt.checkpoint() inside long steps
    belt.put(token)

Deadlines fire from the runtime's ``DeadlineTimer`` (``expire()``) and are also
checked by whichever side is waiting, so an expired deadline ends the stream even
while nobody reads and while the producer is stuck inside one long step.

Ordering (which lock orders what):

- the belt's ``_lock`` orders every end: ``cancel``, ``finish`` and ``fail`` record the
  end reason (and, for a stop, ``cancel_requested``) *in the trace* while holding it,
  before the belt's own state changes. Every producer-side call (``checkpoint``,
  ``wait_for_room``, ``has_room``, ``put``) takes the same lock, so no producer can act
  on an end that the trace does not hold yet; ``release()`` therefore always follows
  a recorded reason;
- the trace's ``_lock`` (taken inside the belt's, never the other way round) orders
  the facts and queues their events; ``Trace.flush()`` delivers the queue in that
  order, outside the belt's lock, one thread at a time, so observers see
  ``cancel_requested``, ``ended`` and ``released`` in that order, each once.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .._errors import Cancelled, EndOfStream, IllegalState
from ._limits import Deadlines, check_capacity
from ._reasons import EndReason
from ._timer import DeadlineTimer
from ._trace import Trace
from ._views import BeltReader, Producer, producing

T = TypeVar("T")

_WAIT: object = object()


@dataclass(frozen=True)
class BeltStatistics:
    """A snapshot of a belt's counters (trio ``MemoryChannelStatistics`` style)."""

    capacity: int
    buffered: int
    peak: int
    produced: int
    consumed: int


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Belt(Generic[T]):
    """A bounded channel with cancellation, deadlines and a trace.

    - The producer is never more than ``capacity`` items ahead of the consumer.
    - ``cancel(reason)`` is idempotent and thread-safe; the first reason wins. It
      drops buffered items and wakes both sides.
    - A natural end (``finish``) keeps buffered items for the consumer to drain.
    - A producer failure (``fail``) ends with ``runtime_error``; the consumer gets
      the buffered items, then the original exception.
    """

    def __init__(
        self,
        capacity: int,
        *,
        deadlines: Deadlines | None = None,
        trace: Trace | None = None,
        timer: DeadlineTimer | None = None,
    ) -> None:
        self.capacity = check_capacity(capacity)
        self.trace = trace if trace is not None else Trace()
        self._clock = self.trace.clock
        self._deadlines = deadlines if deadlines is not None else Deadlines()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._items: collections.deque[T] = collections.deque()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._reason: EndReason | None = None
        self._error: BaseException | None = None
        self._released = False
        self._cancel_callbacks: list[Callable[[EndReason], None]] = []
        self._room_callbacks: list[Callable[[], None]] = []
        self._timer = timer
        self._produced = 0
        self._consumed = 0
        self._peak = 0
        # The stall clock: when the producer last had something it could do (it put an
        # item, or got room on a full belt). It starts at the first item (before it, the
        # prefill is ``first_token``'s to bound) and stops while the belt is full, so a
        # slow reader pauses the producer without being taken for a stalled engine.
        self._stall_from: float | None = None
        self._schedule_deadline()

    # -- state ------------------------------------------------------------------------------

    @property
    def end_reason(self) -> EndReason | None:
        """The reason the belt ended, or None while it runs."""
        return self._reason

    @property
    def cancelled(self) -> bool:
        """True once the belt ended for any reason the producer did not choose."""
        return self._reason is not None and self._reason.is_cancel

    @property
    def released(self) -> bool:
        """True once the producer has exited and the engine let go of the request."""
        return self._released

    def statistics(self) -> BeltStatistics:
        with self._lock:
            return BeltStatistics(
                capacity=self.capacity,
                buffered=len(self._items),
                peak=self._peak,
                produced=self._produced,
                consumed=self._consumed,
            )

    def on_cancel(self, callback: Callable[[EndReason], None]) -> None:
        """Call ``callback(reason)`` once when the belt is cancelled (at once if it was).

        The callback runs on the cancelling thread, so it must be quick and
        thread-safe (set a flag, remove an entry from a queue).
        """
        with self._lock:
            if self._reason is None:
                self._cancel_callbacks.append(callback)
                return
            fire = self.cancelled
        if fire:
            assert self._reason is not None
            callback(self._reason)

    # -- internals ---------------------------------------------------------------------------

    def _schedule_deadline(self) -> None:
        """Tell the runtime's timer when this belt's next deadline falls, if it has one."""
        if self._timer is None:
            return
        with self._lock:
            candidates = self._deadline_candidates_locked()
        if candidates:
            self._timer.schedule(self, min(when for when, _ in candidates))

    def expire(self) -> float | None:
        """Cancel with the deadline's reason if one has passed (the timer calls this).

        Returns the time of the next deadline when none has passed yet, else None.
        """
        with self._lock:
            candidates = self._deadline_candidates_locked()
            if not candidates:
                return None
            when, reason = min(candidates, key=lambda c: c[0])
        if when > self._clock():
            return when
        self.cancel(reason)
        return None

    def _notify_locked(self) -> None:
        self._cond.notify_all()
        if self._async_waiters:
            for loop, fut in self._async_waiters:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(_wake, fut)
            self._async_waiters.clear()

    def _room_locked(self) -> None:
        """Run the one-shot room callbacks (under the lock: they only wake a loop)."""
        if self._room_callbacks:
            callbacks, self._room_callbacks = self._room_callbacks, []
            for callback in callbacks:
                callback()

    def _deadline_candidates_locked(self) -> list[tuple[float, EndReason]]:
        if self._reason is not None:
            return []
        d = self._deadlines
        out: list[tuple[float, EndReason]] = []
        if d.first_token is not None and self._produced == 0:
            out.append((d.first_token, EndReason.FIRST_TOKEN_TIMEOUT))
        if d.total is not None:
            out.append((d.total, EndReason.TOTAL_TIMEOUT))
        if (
            d.stall is not None
            and self._stall_from is not None
            and len(self._items) < self.capacity
        ):
            out.append((self._stall_from + d.stall, EndReason.STALL_TIMEOUT))
        return out

    def _check_deadlines_locked(self) -> tuple[EndReason | None, float | None]:
        """(expired reason, seconds until the next deadline)."""
        candidates = self._deadline_candidates_locked()
        if not candidates:
            return None, None
        when, reason = min(candidates, key=lambda c: c[0])
        remaining = when - self._clock()
        if remaining <= 0:
            return reason, None
        return None, remaining

    def _wait(self, ready: Callable[[], object]) -> object:
        """Block until ``ready()`` (called under the lock) returns something else than _WAIT."""
        while True:
            with self._lock:
                result = ready()
                if result is not _WAIT:
                    return result
                expired, timeout = self._check_deadlines_locked()
                if expired is None:
                    self._cond.wait(timeout)
                    continue
            self.cancel(expired)

    async def _await(self, ready: Callable[[], object]) -> object:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                result = ready()
                if result is not _WAIT:
                    return result
                expired, timeout = self._check_deadlines_locked()
                if expired is None:
                    fut: asyncio.Future[None] = loop.create_future()
                    self._async_waiters.append((loop, fut))
            if expired is not None:
                self.cancel(expired)
                continue
            try:
                if timeout is None:
                    await fut
                else:
                    async with asyncio.timeout(timeout):
                        await fut
            except TimeoutError:
                pass
            finally:
                if not fut.done():
                    with self._lock:
                        if (loop, fut) in self._async_waiters:
                            self._async_waiters.remove((loop, fut))

    def _raise_end_locked(self) -> None:
        assert self._reason is not None
        if self._reason is EndReason.RUNTIME_ERROR and self._error is not None:
            raise self._error
        raise EndOfStream(self._reason)

    # -- consumer side -----------------------------------------------------------------------

    def _take_ready(self) -> object:
        if self._items:
            if len(self._items) >= self.capacity and self._stall_from is not None:
                self._stall_from = self._clock()  # room again: the stall clock restarts
            item = self._items.popleft()
            self._consumed += 1
            self._notify_locked()
            self._room_locked()
            return item
        if self._reason is not None:
            self._raise_end_locked()
        return _WAIT

    def get(self) -> T:
        """Take the next item, blocking while the belt is empty.

        Raises ``EndOfStream`` (with ``.reason``) once the belt has ended and is
        empty, or the producer's own exception after ``runtime_error``. Taking an
        item makes room, which wakes a producer blocked on a full belt.
        """
        return self._wait(self._take_ready)  # type: ignore[return-value]

    async def aget(self) -> T:
        """Async ``get()``: waits without blocking the event loop."""
        return await self._await(self._take_ready)  # type: ignore[return-value]

    def cancel(self, reason: EndReason = EndReason.USER_CANCEL) -> bool:
        """End the stream with ``reason`` unless it already ended; thread-safe.

        Drops buffered items, wakes a blocked producer (its next checkpoint raises
        ``Cancelled``) and a blocked consumer (it sees ``EndOfStream``), and runs
        the ``on_cancel`` callbacks. Returns True if this call ended the belt.
        """
        with self._lock:
            if self._reason is not None:
                return False
            # The trace first, under this lock: a producer that sees the cancel (it
            # needs this lock to) finds the stop and its reason already recorded.
            self.trace.record_end(reason, cancel_at=self._clock())
            self._reason = reason
            self._items.clear()
            self._notify_locked()
            self._room_locked()  # a producer waiting for room must look again
            callbacks, self._cancel_callbacks = self._cancel_callbacks, []
        self.trace.flush()
        for callback in callbacks:
            callback(reason)
        return True

    def close(self) -> None:
        """The consumer stops reading: cancels with ``user_cancel`` (no-op once ended)."""
        self.cancel(EndReason.USER_CANCEL)

    async def aclose(self) -> None:
        self.close()

    def __iter__(self) -> BeltReader[T]:
        return BeltReader(self)

    def __aiter__(self) -> BeltReader[T]:
        return BeltReader(self)

    # -- producer side -----------------------------------------------------------------------

    @property
    def producer(self) -> Producer[T]:
        """The producer's end: what an engine is given (see ``Producer``)."""
        return Producer(self)

    def checkpoint(self) -> None:
        """Raise ``Cancelled`` if the belt was cancelled or a deadline has passed.

        Cheap (one lock, one clock read): call it at every safe point.
        """
        with self._lock:
            if self._reason is not None:
                raise Cancelled(self._reason)
            expired, _ = self._check_deadlines_locked()
        if expired is not None:
            self.cancel(expired)
            raise Cancelled(self._reason or expired)

    def _room_ready(self) -> object:
        if self._reason is not None:
            raise Cancelled(self._reason)
        if len(self._items) < self.capacity and self._check_deadlines_locked()[0] is None:
            return None
        return _WAIT  # full, or a deadline passed: _wait cancels and we raise above

    def wait_for_room(self) -> None:
        """Block while the belt is full; raise ``Cancelled`` once it is cancelled.

        Call it *before* computing the next item, so a slow reader costs no compute.
        It is also a checkpoint: a deadline that has passed cancels and raises, even
        when there is room.
        """
        self._wait(self._room_ready)

    async def await_for_room(self) -> None:
        """Async ``wait_for_room()``."""
        await self._await(self._room_ready)

    def has_room(self) -> bool:
        """Non-blocking: True if a ``put_nowait`` now would not exceed the capacity.

        False once the belt has ended. Also a checkpoint for deadlines: one that has
        passed cancels the belt here.
        """
        with self._lock:
            if self._reason is not None:
                return False
            expired, _ = self._check_deadlines_locked()
            if expired is None:
                return len(self._items) < self.capacity
        self.cancel(expired)
        return False

    def room(self) -> int:
        """Non-blocking: how many ``put_nowait`` calls fit now (0 once the belt ended);
        a batch engine that verifies a draft puts several items in one step."""
        with self._lock:
            return 0 if self._reason is not None else max(0, self.capacity - len(self._items))

    def on_room(self, callback: Callable[[], None]) -> bool:
        """Call ``callback()`` once, when a read makes room or the belt ends.

        Returns False (and registers nothing) if there is room or the belt ended
        already. The callback runs under the belt's lock on the reading or
        cancelling thread: it must only wake something (set an event).
        """
        with self._lock:
            if self._reason is not None or len(self._items) < self.capacity:
                return False
            self._room_callbacks.append(callback)
            return True

    def put_nowait(self, item: T) -> None:
        """Add ``item`` without waiting; raises ``Cancelled`` once the belt ended.

        Call it after ``has_room()`` said yes (only the producer adds items, so the
        room is still there); a put on a full belt raises ``IllegalState``.
        """
        with self._lock:
            full = self._reason is None and len(self._items) >= self.capacity
        if full:
            raise IllegalState("put_nowait on a full belt: check has_room() first")
        self._append(item)

    def _append(self, item: T) -> None:
        with self._lock:
            if self._reason is not None:
                raise Cancelled(self._reason)
            now = self._clock()
            self._items.append(item)
            self._produced += 1
            first = self._stall_from is None
            self._stall_from = now
            buffered = len(self._items)
            if buffered > self._peak:
                self._peak = buffered
                self.trace.buffer_peak = buffered
            self._notify_locked()
        self.trace.mark_token(now)
        if first and self._deadlines.stall is not None:
            self._schedule_deadline()  # the stall clock starts with the first token

    def put(self, item: T) -> None:
        """Wait for room, then add ``item``; raises ``Cancelled`` once cancelled."""
        self.wait_for_room()
        self._append(item)

    async def aput(self, item: T) -> None:
        await self.await_for_room()
        self._append(item)

    def _end(self, reason: EndReason, error: BaseException | None = None) -> bool:
        with self._lock:
            if self._reason is not None:
                return False
            self.trace.record_end(reason, error)
            self._reason = reason
            self._error = error
            self._notify_locked()
            self._cancel_callbacks = []
            self._room_callbacks = []
        self.trace.flush()
        return True

    def finish(self, reason: EndReason = EndReason.STOP) -> bool:
        """The producer ends naturally (``stop`` or ``length``); buffered items stay."""
        return self._end(reason)

    def fail(self, error: BaseException) -> bool:
        """The producer failed: ends with ``runtime_error``; the consumer gets ``error``."""
        return self._end(EndReason.RUNTIME_ERROR, error)

    def start(self) -> None:
        """The producer starts: marks admission (the stall clock waits for the first token)."""
        self.trace.mark_admitted()

    def release(self) -> None:
        """The engine has let go of the request (producer exited, slot free)."""
        # The trace first: whoever wakes on the release must find its time recorded.
        self.trace.mark_released()
        with self._lock:
            self._released = True
            self._notify_locked()

    def wait_released(self, timeout: float | None = None) -> bool:
        """Block until ``release()``; False if ``timeout`` seconds passed first."""
        return self.trace.wait_released(timeout)

    async def await_released(self, timeout: float | None = None) -> bool:
        """Async ``wait_released()``."""

        def ready() -> object:
            return True if self._released else _WAIT

        try:
            async with asyncio.timeout(timeout):
                await self._await(ready)
        except TimeoutError:
            return False
        return True

    def produce(
        self,
        target: Callable[[Belt[T]], EndReason | None],
        *,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        """Run ``target(self)`` as this belt's producer, in the calling thread.

        ``target`` returns the natural end reason (None means ``stop``). A
        ``Cancelled`` raised inside it ends quietly (the belt has the reason); any
        other exception ends with ``runtime_error``. Then ``on_exit`` runs (free the
        slot) and the release is recorded, even if ``on_exit`` fails.
        """
        with producing(self, on_exit):
            self.finish(target(self) or EndReason.STOP)

    async def aproduce(
        self,
        target: Callable[[Belt[T]], Awaitable[EndReason | None]],
        *,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        """``produce()`` for a coroutine producer. A cancelled task ends with ``shutdown``."""
        with producing(self, on_exit):
            self.finish(await target(self) or EndReason.STOP)

    def __repr__(self) -> str:
        s = self.statistics()
        reason = self._reason.value if self._reason else None
        return f"<Belt {s.buffered}/{s.capacity} produced={s.produced} end_reason={reason!r}>"
