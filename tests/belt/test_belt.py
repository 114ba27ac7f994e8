"""The belt: backpressure, cancellation, deadlines, consumers leaving, producer failures.

Synchronisation is explicit: the tests wait on events, on the belt's own release, or on a
thread's live stack showing it asleep inside a call (``wait_until_blocked``). Timeouts are
only safety nets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tokenbelt
from tokenbelt import Cancelled, EndOfStream, InvalidArgument
from tokenbelt.belt import Belt, BeltStatistics, Deadlines, EndReason, Trace

NET = 5.0  # safety net for every wait, never the assertion
CAPACITIES = [1, 2, 20]


# -- helpers --------------------------------------------------------------------------------


def wait_until_blocked(thread: threading.Thread, inside: str) -> None:
    """Wait until ``thread`` sleeps in a ``threading`` wait reached through ``inside``.

    Reads the thread's live stack (``sys._current_frames``): the condition is the
    thread's state, not elapsed time.
    """
    deadline = time.monotonic() + NET
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident or -1)
        if (
            frame is not None
            and frame.f_code.co_name == "wait"
            and frame.f_code.co_filename == threading.__file__
        ):
            names = set()
            f: Any = frame
            while f is not None:
                names.add(f.f_code.co_name)
                f = f.f_back
            if inside in names:
                return
        time.sleep(0.001)
    pytest.fail(f"{thread.name} never blocked inside {inside}()")


class Rig:
    """Threads, gates and belts of one test, torn down even when the test fails."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.gates: list[threading.Event] = []
        self.belts: list[Belt[Any]] = []

    def belt(self, capacity: int = 2, **kwargs: Any) -> Belt[Any]:
        belt: Belt[Any] = Belt(capacity, **kwargs)
        self.belts.append(belt)
        return belt

    def gate(self) -> threading.Event:
        gate = threading.Event()
        self.gates.append(gate)
        return gate

    def thread(self, fn: Callable[..., object], *args: object, name: str) -> threading.Thread:
        thread = threading.Thread(target=fn, args=args, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def producer(self, belt: Belt[Any], target: Callable[[Belt[Any]], Any]) -> threading.Thread:
        return self.thread(belt.produce, target, name="test-producer")

    def close(self) -> None:
        for gate in self.gates:
            gate.set()
        for belt in self.belts:
            belt.cancel(EndReason.SHUTDOWN)
        for thread in self.threads:
            thread.join(NET)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


def endless(belt: Belt[int]) -> EndReason:
    """A producer that never ends by itself."""
    for i in itertools.count():
        belt.put(i)
    raise AssertionError("unreachable")


async def aendless(belt: Belt[int]) -> EndReason:
    for i in itertools.count():
        await belt.aput(i)
    raise AssertionError("unreachable")


def drain(belt: Belt[Any]) -> tuple[list[Any], EndReason]:
    items = []
    while True:
        try:
            items.append(belt.get())
        except EndOfStream as end:
            return items, end.reason


async def adrain(belt: Belt[Any]) -> tuple[list[Any], EndReason]:
    items = []
    while True:
        try:
            items.append(await belt.aget())
        except EndOfStream as end:
            return items, end.reason


# -- backpressure ---------------------------------------------------------------------------


class AheadProbe:
    """Records how far the producer is ahead after each put, and lets the consumer hold
    off until the producer has filled the belt, so the producer really tries to run ahead.
    """

    def __init__(self, belt: Belt[int], items: int) -> None:
        self.belt = belt
        self.items = items
        self.ahead: list[int] = []
        self._cond = threading.Condition()
        self._async: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def record(self) -> None:
        """Producer side, after each put."""
        s = self.belt.statistics()
        with self._cond:
            self.ahead.append(s.produced - s.consumed)
            self._cond.notify_all()
            waiters, self._async = self._async, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def _filled(self, consumed: int) -> bool:
        return len(self.ahead) >= min(self.items, consumed + self.belt.capacity)

    def wait_filled(self, consumed: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._filled(consumed), NET)

    async def await_filled(self, consumed: int) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(NET):
            while True:
                event = asyncio.Event()
                with self._cond:
                    if self._filled(consumed):
                        return
                    self._async.append((loop, event))
                await event.wait()

    def put_all(self, belt: Belt[int]) -> None:
        for i in range(self.items):
            belt.put(i)
            self.record()

    async def aput_all(self, belt: Belt[int]) -> None:
        for i in range(self.items):
            await belt.aput(i)
            self.record()

    def consume(self) -> list[int]:
        got: list[int] = []
        while True:
            self.wait_filled(len(got))
            try:
                got.append(self.belt.get())
            except EndOfStream:
                return got

    async def aconsume(self) -> list[int]:
        got: list[int] = []
        while True:
            await self.await_filled(len(got))
            try:
                got.append(await self.belt.aget())
            except EndOfStream:
                return got

    def check(self, got: list[int]) -> None:
        capacity = self.belt.capacity
        assert got == list(range(self.items))
        assert max(self.ahead) <= capacity, "the producer ran more than capacity ahead"
        assert max(self.ahead) == capacity, "the producer never filled the belt"
        stats = self.belt.statistics()
        assert stats.peak == capacity
        assert stats.produced == stats.consumed == self.items
        assert self.belt.released
        assert self.belt.end_reason is EndReason.STOP


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_thread_producer_sync_consumer_never_more_than_capacity_ahead(
    rig: Rig, capacity: int
) -> None:
    belt = rig.belt(capacity)
    probe = AheadProbe(belt, items=3 * capacity + 5)
    producer = rig.producer(belt, probe.put_all)
    got = probe.consume()
    producer.join(NET)
    probe.check(got)


@pytest.mark.anyio
@pytest.mark.parametrize("capacity", CAPACITIES)
async def test_thread_producer_async_consumer_never_more_than_capacity_ahead(
    rig: Rig, capacity: int
) -> None:
    belt = rig.belt(capacity)
    probe = AheadProbe(belt, items=3 * capacity + 5)
    producer = rig.producer(belt, probe.put_all)
    got = await probe.aconsume()
    assert await belt.await_released(NET)
    producer.join(NET)
    probe.check(got)


@pytest.mark.anyio
@pytest.mark.parametrize("capacity", CAPACITIES)
async def test_coroutine_producer_async_consumer_never_more_than_capacity_ahead(
    capacity: int,
) -> None:
    belt: Belt[int] = Belt(capacity)
    probe = AheadProbe(belt, items=3 * capacity + 5)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(belt.aproduce(probe.aput_all))  # type: ignore[arg-type]
        got = await probe.aconsume()
    probe.check(got)


@pytest.mark.anyio
@pytest.mark.parametrize("capacity", CAPACITIES)
async def test_coroutine_producer_sync_consumer_never_more_than_capacity_ahead(
    rig: Rig, capacity: int
) -> None:
    belt = rig.belt(capacity)
    probe = AheadProbe(belt, items=3 * capacity + 5)
    loop = asyncio.get_running_loop()
    consumed = asyncio.Event()
    result: list[list[int]] = []

    def consumer() -> None:
        try:
            result.append(probe.consume())
        finally:
            loop.call_soon_threadsafe(consumed.set)

    thread = rig.thread(consumer, name="test-consumer")
    await belt.aproduce(probe.aput_all)  # type: ignore[arg-type]
    async with asyncio.timeout(NET):
        await consumed.wait()
    thread.join(NET)
    probe.check(result[0])


def test_put_without_produce_blocks_until_room(rig: Rig) -> None:
    belt = rig.belt(1)
    belt.put("a")
    second = rig.thread(belt.put, "b", name="test-producer")
    wait_until_blocked(second, "put")
    assert belt.statistics().buffered == 1
    assert belt.get() == "a"
    second.join(NET)
    assert belt.get() == "b"
    assert belt.statistics().produced == 2


# -- cancellation ---------------------------------------------------------------------------


def test_cancel_wakes_thread_producer_blocked_on_full_belt(rig: Rig) -> None:
    belt = rig.belt(2)
    producer = rig.producer(belt, endless)
    wait_until_blocked(producer, "put")
    assert belt.statistics().produced == 2

    assert belt.cancel(EndReason.USER_CANCEL)
    assert belt.wait_released(NET)
    producer.join(NET)
    assert not producer.is_alive()
    assert belt.statistics().produced == 2
    assert belt.statistics().buffered == 0  # a cancel drops what was not read
    with pytest.raises(EndOfStream) as end:
        belt.get()
    assert end.value.reason is EndReason.USER_CANCEL
    assert belt.trace.end_reason is EndReason.USER_CANCEL
    assert belt.trace.cancel_to_release is not None


@pytest.mark.anyio
async def test_cancel_wakes_coroutine_producer_blocked_on_full_belt() -> None:
    belt: Belt[int] = Belt(2)
    calling_put = asyncio.Event()
    calls = 0

    async def target(b: Belt[int]) -> EndReason:
        nonlocal calls
        for i in itertools.count():
            calls += 1
            if calls == 3:
                calling_put.set()
            await b.aput(i)  # nothing yields between set() and this wait: it is blocked
        raise AssertionError("unreachable")

    task = asyncio.create_task(belt.aproduce(target))
    await calling_put.wait()
    assert not task.done()
    assert belt.statistics().produced == 2

    belt.cancel(EndReason.CLIENT_DISCONNECT)
    async with asyncio.timeout(NET):
        await task
    assert belt.released
    assert belt.end_reason is EndReason.CLIENT_DISCONNECT
    assert belt.statistics().produced == 2


def test_cancel_wakes_sync_consumer_waiting_on_empty_belt(rig: Rig) -> None:
    belt = rig.belt(2)
    outcome: list[BaseException] = []

    def consumer() -> None:
        try:
            belt.get()
        except BaseException as exc:
            outcome.append(exc)

    thread = rig.thread(consumer, name="test-consumer")
    wait_until_blocked(thread, "get")
    assert belt.cancel(EndReason.CLIENT_DISCONNECT)
    thread.join(NET)
    assert not thread.is_alive()
    assert isinstance(outcome[0], EndOfStream)
    assert outcome[0].reason is EndReason.CLIENT_DISCONNECT


@pytest.mark.anyio
async def test_cancel_wakes_async_consumer_waiting_on_empty_belt() -> None:
    belt: Belt[str] = Belt(2)
    waiting = asyncio.Event()

    async def consumer() -> EndReason:
        waiting.set()
        try:
            await belt.aget()  # suspends here before the test body runs again
        except EndOfStream as end:
            return end.reason
        raise AssertionError("got an item from an empty belt")

    task = asyncio.create_task(consumer())
    await waiting.wait()
    assert not task.done()
    belt.cancel(EndReason.USER_CANCEL)
    async with asyncio.timeout(NET):
        assert await task is EndReason.USER_CANCEL


@pytest.mark.anyio
async def test_cancel_from_third_thread_wakes_async_consumer_while_producer_is_stuck(
    rig: Rig,
) -> None:
    belt = rig.belt(2)
    stuck = rig.gate()

    def target(b: Belt[str]) -> EndReason:
        stuck.wait()  # a long native step that does not watch the belt
        b.put("late")
        return EndReason.STOP

    producer = rig.producer(belt, target)
    waiting = asyncio.Event()

    async def consumer() -> tuple[list[str], EndReason]:
        waiting.set()
        return await adrain(belt)

    task = asyncio.create_task(consumer())
    await waiting.wait()
    canceller = rig.thread(belt.cancel, EndReason.SHUTDOWN, name="test-canceller")
    async with asyncio.timeout(NET):
        items, reason = await task
    assert (items, reason) == ([], EndReason.SHUTDOWN)
    assert producer.is_alive()  # still inside its step
    assert not belt.released

    stuck.set()
    assert await belt.await_released(NET)
    canceller.join(NET)
    producer.join(NET)
    assert belt.statistics().produced == 0  # the late put was refused


def test_cancel_from_third_thread_wakes_blocked_producer(rig: Rig) -> None:
    belt = rig.belt(1)
    producer = rig.producer(belt, endless)
    wait_until_blocked(producer, "put")
    canceller = rig.thread(belt.cancel, EndReason.USER_CANCEL, name="test-canceller")
    canceller.join(NET)
    assert belt.wait_released(NET)
    producer.join(NET)
    assert drain(belt) == ([], EndReason.USER_CANCEL)


def test_second_cancel_keeps_first_reason() -> None:
    belt: Belt[str] = Belt(2)
    assert belt.cancel(EndReason.CLIENT_DISCONNECT) is True
    assert belt.cancel(EndReason.USER_CANCEL) is False
    assert belt.cancel(EndReason.TOTAL_TIMEOUT) is False
    assert belt.finish() is False
    assert belt.fail(RuntimeError("late")) is False
    assert belt.end_reason is EndReason.CLIENT_DISCONNECT
    assert belt.trace.end_reason is EndReason.CLIENT_DISCONNECT
    assert belt.trace.error is None
    with pytest.raises(Cancelled) as exc:
        belt.checkpoint()
    assert exc.value.reason is EndReason.CLIENT_DISCONNECT


def test_concurrent_cancels_one_reason_wins(rig: Rig) -> None:
    belt = rig.belt(2)
    reasons = [
        EndReason.USER_CANCEL,
        EndReason.CLIENT_DISCONNECT,
        EndReason.SHUTDOWN,
        EndReason.TOTAL_TIMEOUT,
        EndReason.STALL_TIMEOUT,
        EndReason.FIRST_TOKEN_TIMEOUT,
    ]
    barrier = threading.Barrier(len(reasons))
    won: list[EndReason] = []

    def cancel(reason: EndReason) -> None:
        barrier.wait(NET)
        if belt.cancel(reason):
            won.append(reason)

    threads = [rig.thread(cancel, r, name=f"test-cancel-{r.value}") for r in reasons]
    for t in threads:
        t.join(NET)
    assert len(won) == 1
    assert belt.end_reason is won[0]
    assert belt.trace.end_reason is won[0]


def test_on_cancel_callbacks_run_once_with_the_first_reason() -> None:
    belt: Belt[str] = Belt(2)
    calls: list[tuple[str, EndReason]] = []
    belt.on_cancel(lambda r: calls.append(("a", r)))
    belt.on_cancel(lambda r: calls.append(("b", r)))
    belt.cancel(EndReason.CLIENT_DISCONNECT)
    belt.cancel(EndReason.USER_CANCEL)
    belt.close()
    assert calls == [("a", EndReason.CLIENT_DISCONNECT), ("b", EndReason.CLIENT_DISCONNECT)]

    # Registered after the cancel: runs at once, still once.
    belt.on_cancel(lambda r: calls.append(("late", r)))
    belt.cancel(EndReason.SHUTDOWN)
    assert calls[2:] == [("late", EndReason.CLIENT_DISCONNECT)]


def test_on_cancel_does_not_run_after_a_natural_end() -> None:
    belt: Belt[str] = Belt(2)
    calls: list[EndReason] = []
    belt.on_cancel(calls.append)
    belt.finish(EndReason.LENGTH)
    belt.cancel(EndReason.USER_CANCEL)
    belt.on_cancel(calls.append)
    assert calls == []
    assert belt.end_reason is EndReason.LENGTH
    assert not belt.cancelled


def test_checkpoint_raises_only_after_cancel() -> None:
    belt: Belt[str] = Belt(1)
    belt.checkpoint()
    belt.cancel(EndReason.USER_CANCEL)
    with pytest.raises(Cancelled) as exc:
        belt.checkpoint()
    assert exc.value.reason is EndReason.USER_CANCEL
    with pytest.raises(Cancelled):
        belt.put("x")
    assert belt.cancelled


# -- deadlines while the producer is stuck --------------------------------------------------

DEADLINE_S = 0.05


def _deadlines(reason: EndReason) -> Deadlines:
    now = time.monotonic()
    if reason is EndReason.FIRST_TOKEN_TIMEOUT:
        return Deadlines(first_token=now + DEADLINE_S)
    if reason is EndReason.TOTAL_TIMEOUT:
        return Deadlines(total=now + DEADLINE_S)
    return Deadlines(stall=DEADLINE_S)


def _stuck_producer(reason: EndReason, stuck: threading.Event) -> Callable[[Belt[str]], Any]:
    def target(b: Belt[str]) -> EndReason:
        if reason is not EndReason.FIRST_TOKEN_TIMEOUT:
            # The first token came, so only this deadline can fire. On a slow machine the
            # deadline may beat this put; the producer must still end up stuck below.
            with contextlib.suppress(Cancelled):
                b.put("a")
        stuck.wait()  # a native step that never looks at the belt
        b.put("late")
        return EndReason.STOP

    return target


DEADLINE_REASONS = [
    EndReason.FIRST_TOKEN_TIMEOUT,
    EndReason.TOTAL_TIMEOUT,
    EndReason.STALL_TIMEOUT,
]


def _check_deadline_end(
    belt: Belt[str], producer: threading.Thread, items: list[str], reason: EndReason
) -> None:
    # A deadline drops what was not read, so only a prefix of the script is certain.
    assert items in ([], ["a"])
    if reason is EndReason.FIRST_TOKEN_TIMEOUT:
        assert items == []
    # The consumer saw the end while the producer is still inside its step.
    assert producer.is_alive()
    assert not belt.released
    assert belt.end_reason is reason
    assert belt.trace.end_reason is reason
    assert belt.trace.cancel_requested is not None


@pytest.mark.parametrize("reason", DEADLINE_REASONS, ids=lambda r: r.value)
def test_deadline_ends_sync_consumer_while_producer_is_stuck(rig: Rig, reason: EndReason) -> None:
    stuck = rig.gate()
    belt = rig.belt(2, deadlines=_deadlines(reason))
    producer = rig.producer(belt, _stuck_producer(reason, stuck))
    items, end = drain(belt)
    assert end is reason
    _check_deadline_end(belt, producer, items, reason)

    stuck.set()
    assert belt.wait_released(NET)
    producer.join(NET)
    assert belt.end_reason is reason  # the refused late put did not change it


@pytest.mark.anyio
@pytest.mark.parametrize("reason", DEADLINE_REASONS, ids=lambda r: r.value)
async def test_deadline_ends_async_consumer_while_producer_is_stuck(
    rig: Rig, reason: EndReason
) -> None:
    stuck = rig.gate()
    belt = rig.belt(2, deadlines=_deadlines(reason))
    producer = rig.producer(belt, _stuck_producer(reason, stuck))
    async with asyncio.timeout(NET):
        items, end = await adrain(belt)
    assert end is reason
    _check_deadline_end(belt, producer, items, reason)

    stuck.set()
    assert await belt.await_released(NET)
    producer.join(NET)
    assert belt.end_reason is reason


def test_deadline_wakes_producer_blocked_on_full_belt(rig: Rig) -> None:
    belt = rig.belt(1, deadlines=Deadlines(total=time.monotonic() + DEADLINE_S))
    producer = rig.producer(belt, endless)
    # Nobody reads: the producer itself notices the deadline while it waits for room.
    assert belt.wait_released(NET)
    producer.join(NET)
    assert belt.end_reason is EndReason.TOTAL_TIMEOUT
    assert belt.statistics().produced == 1


def test_deadlines_that_do_not_expire_do_not_fire(rig: Rig) -> None:
    far = time.monotonic() + 600
    belt = rig.belt(2, deadlines=Deadlines(first_token=far, total=far, stall=600))

    def target(b: Belt[int]) -> EndReason:
        for i in range(10):
            b.put(i)
        return EndReason.STOP

    producer = rig.producer(belt, target)
    assert drain(belt) == (list(range(10)), EndReason.STOP)
    producer.join(NET)
    assert belt.trace.end_reason is EndReason.STOP
    assert belt.trace.cancel_requested is None


# -- consumers that stop reading ------------------------------------------------------------


def _assert_user_cancel_released(belt: Belt[Any]) -> None:
    assert belt.end_reason is EndReason.USER_CANCEL
    assert belt.trace.end_reason is EndReason.USER_CANCEL
    assert belt.trace.cancel_requested is not None
    assert belt.trace.released is not None
    assert belt.trace.cancel_to_release is not None


def test_break_out_of_for_loop_cancels_and_releases(rig: Rig) -> None:
    belt = rig.belt(2)
    producer = rig.producer(belt, endless)
    got = []
    for item in belt:
        got.append(item)
        if len(got) == 3:
            break
    assert belt.trace.wait_released(NET)
    producer.join(NET)
    assert got == [0, 1, 2]
    _assert_user_cancel_released(belt)


@pytest.mark.anyio
async def test_break_out_of_async_for_cancels_and_releases(rig: Rig) -> None:
    belt = rig.belt(2)
    producer = rig.producer(belt, endless)
    got = []
    async for item in belt:
        got.append(item)
        if len(got) == 3:
            break
    assert await belt.await_released(NET)
    producer.join(NET)
    assert got == [0, 1, 2]
    _assert_user_cancel_released(belt)


@pytest.mark.anyio
async def test_aclose_on_reader_cancels_coroutine_producer() -> None:
    belt: Belt[int] = Belt(2)
    task = asyncio.create_task(belt.aproduce(aendless))
    reader = aiter(belt)
    assert await anext(reader) == 0
    await reader.aclose()
    async with asyncio.timeout(NET):
        await task
    assert belt.released
    _assert_user_cancel_released(belt)


@pytest.mark.anyio
async def test_belt_aclose_cancels(rig: Rig) -> None:
    belt = rig.belt(2)
    producer = rig.producer(belt, endless)
    assert await belt.aget() == 0
    await belt.aclose()
    assert belt.wait_released(NET)
    producer.join(NET)
    _assert_user_cancel_released(belt)


def test_reader_close_cancels(rig: Rig) -> None:
    belt = rig.belt(2)
    producer = rig.producer(belt, endless)
    reader = iter(belt)
    assert next(reader) == 0
    reader.close()
    assert belt.wait_released(NET)
    producer.join(NET)
    _assert_user_cancel_released(belt)


def test_garbage_collected_reader_cancels(rig: Rig) -> None:
    belt = rig.belt(2)
    producer = rig.producer(belt, endless)
    reader = iter(belt)
    assert next(reader) == 0
    assert belt.end_reason is None
    del reader
    gc.collect()
    assert belt.wait_released(NET)
    producer.join(NET)
    _assert_user_cancel_released(belt)


@pytest.mark.anyio
async def test_garbage_collected_async_reader_cancels() -> None:
    belt: Belt[int] = Belt(2)
    task = asyncio.create_task(belt.aproduce(aendless))
    reader = aiter(belt)
    assert await anext(reader) == 0
    del reader
    gc.collect()
    async with asyncio.timeout(NET):
        await task
    _assert_user_cancel_released(belt)


def test_break_after_natural_end_keeps_stop(rig: Rig) -> None:
    belt = rig.belt(5)

    def target(b: Belt[int]) -> EndReason:
        for i in range(3):
            b.put(i)
        return EndReason.STOP

    producer = rig.producer(belt, target)
    assert belt.wait_released(NET)  # the stream ended with items still on the belt
    producer.join(NET)
    for item in belt:
        assert item == 0
        break
    gc.collect()
    assert belt.end_reason is EndReason.STOP
    assert belt.trace.end_reason is EndReason.STOP
    assert belt.trace.cancel_requested is None
    assert not belt.cancelled
    assert belt.get() == 1  # a natural end keeps what was produced


# -- producer failures ----------------------------------------------------------------------


def test_producer_exception_reaches_consumer_after_the_items(rig: Rig) -> None:
    belt = rig.belt(3)
    error = RuntimeError("boom")

    def target(b: Belt[str]) -> EndReason:
        b.put("a")
        b.put("b")
        raise error

    producer = rig.producer(belt, target)
    assert belt.wait_released(NET)  # the failure happened with both items buffered
    producer.join(NET)
    assert belt.end_reason is EndReason.RUNTIME_ERROR
    got: list[str] = []

    def read_all() -> None:
        for item in belt:
            got.append(item)

    with pytest.raises(RuntimeError) as raised:
        read_all()
    assert got == ["a", "b"]
    assert raised.value is error
    with pytest.raises(RuntimeError) as again:
        belt.get()
    assert again.value is error
    assert belt.trace.end_reason is EndReason.RUNTIME_ERROR
    assert belt.trace.error == "RuntimeError: boom"
    assert not belt.cancelled


@pytest.mark.anyio
async def test_coroutine_producer_exception_reaches_async_consumer() -> None:
    belt: Belt[str] = Belt(3)
    error = ValueError("bad token")

    async def target(b: Belt[str]) -> EndReason:
        await b.aput("a")
        await b.aput("b")
        raise error

    await belt.aproduce(target)
    assert belt.released
    got: list[str] = []

    async def read_all() -> None:
        async for item in belt:
            got.append(item)

    with pytest.raises(ValueError, match="bad token") as raised:
        await read_all()
    assert got == ["a", "b"]
    assert raised.value is error
    assert belt.end_reason is EndReason.RUNTIME_ERROR


def test_on_exit_runs_and_release_is_recorded_when_on_exit_fails() -> None:
    belt: Belt[str] = Belt(1)
    exited: list[bool] = []

    def on_exit() -> None:
        exited.append(True)
        raise OSError("slot cleanup failed")

    with pytest.raises(OSError, match="slot cleanup failed"):
        belt.produce(lambda b: EndReason.LENGTH, on_exit=on_exit)
    assert exited == [True]
    assert belt.released
    assert belt.end_reason is EndReason.LENGTH


@pytest.mark.anyio
async def test_cancelled_coroutine_producer_ends_with_shutdown() -> None:
    belt: Belt[int] = Belt(1)
    task = asyncio.create_task(belt.aproduce(aendless))
    assert await belt.aget() == 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert belt.end_reason is EndReason.SHUTDOWN
    assert belt.released


# -- statistics and input -------------------------------------------------------------------


def test_statistics_snapshot() -> None:
    belt: Belt[int] = Belt(5)
    for i in range(3):
        belt.put(i)
    first = belt.statistics()
    assert first == BeltStatistics(capacity=5, buffered=3, peak=3, produced=3, consumed=0)
    belt.get()
    belt.get()
    belt.put(3)
    second = belt.statistics()
    assert second == BeltStatistics(capacity=5, buffered=2, peak=3, produced=4, consumed=2)
    assert first.buffered == 3  # a snapshot does not follow the belt
    with pytest.raises(dataclasses.FrozenInstanceError):
        second.buffered = 0  # type: ignore[misc]
    assert belt.trace.buffer_peak == 3
    belt.cancel()
    assert belt.statistics().buffered == 0
    assert "produced=4" in repr(belt)


@pytest.mark.parametrize("capacity", [0, -1, True, 1.5, "2", None])
def test_bad_capacity_is_rejected(capacity: Any) -> None:
    with pytest.raises(InvalidArgument, match="capacity"):
        Belt(capacity)
    with pytest.raises(ValueError, match="capacity"):
        Belt(capacity)


def test_invalid_argument_is_public_and_a_value_error() -> None:
    assert tokenbelt.InvalidArgument is InvalidArgument
    assert issubclass(InvalidArgument, ValueError)
    assert issubclass(InvalidArgument, tokenbelt.TokenbeltError)


def test_wait_released_times_out_while_running() -> None:
    belt: Belt[int] = Belt(1)
    assert belt.wait_released(0) is False
    belt.finish()
    assert belt.wait_released(0) is False
    belt.release()
    assert belt.wait_released(0) is True


@pytest.mark.anyio
async def test_await_released_times_out_while_running() -> None:
    belt: Belt[int] = Belt(1, trace=Trace())
    belt.finish()
    assert await belt.await_released(0.01) is False
    belt.release()
    assert await belt.await_released(NET) is True


def test_wait_for_room_is_a_checkpoint_even_with_room() -> None:
    """A deadline that passed while nobody waited is caught before the next compute."""
    belt: Belt[str] = Belt(4, deadlines=Deadlines(total=time.monotonic() - 1.0))
    with pytest.raises(Cancelled) as raised:
        belt.wait_for_room()
    assert raised.value.reason is EndReason.TOTAL_TIMEOUT
    assert belt.end_reason is EndReason.TOTAL_TIMEOUT
    assert belt.statistics().buffered == 0


@pytest.mark.anyio
async def test_await_for_room_is_a_checkpoint_even_with_room() -> None:
    belt: Belt[str] = Belt(4, deadlines=Deadlines(total=time.monotonic() - 1.0))
    with pytest.raises(Cancelled):
        await belt.await_for_room()
    assert belt.end_reason is EndReason.TOTAL_TIMEOUT
