"""Per-item overhead of the belt: a thread producer to an async and to a sync consumer.

Two measurements, both printed, because they answer different questions:

- **latency** (the headline): the producer is paced like a decode loop, so the consumer is
  already waiting when each item arrives. Each item carries ``perf_counter_ns()`` taken just
  before ``put()``; the consumer subtracts it from the time it received the item. The median
  of these put-to-receive latencies is what the belt adds to every token in real use: a
  cross-thread wake-up plus the channel's own bookkeeping.
- **floor**: the same paced latency through the bare primitives the belt wakes its
  consumer with (``loop.call_soon_threadsafe`` resolving a future; a ``threading.Condition``
  notify), with no belt at all. Belt minus floor is what the belt itself adds.
- **throughput**: the producer puts as fast as it can into a belt of capacity 64; per-item
  cost is wall time divided by items. This is the bookkeeping cost when the consumer rarely
  has to be woken, a lower bound rather than what a token pays.

The async rows run on the stock asyncio loop; ``--loop uvloop`` runs them on uvloop
when it is installed (it is not a tokenbelt dependency), to show how much of the async
figure is the event loop's cross-thread wake-up rather than the belt.

Run: ``.venv/bin/python benchmarks/belt.py [--items N] [--loop asyncio|uvloop] [--json]``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import _harness
from tokenbelt.belt import Belt, EndReason

#: Gap between two puts in the paced run: long enough for the consumer to be waiting again,
#: much shorter than a real decode step (about 11 ms).
PACE_S = 50e-6
THROUGHPUT_CAPACITY = 64

R = TypeVar("R")

#: Builds the event loop the async rows run on (None: asyncio's default).
_loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None


def _run(coro: Coroutine[Any, Any, R]) -> R:
    with asyncio.Runner(loop_factory=_loop_factory) as runner:
        return runner.run(coro)


def _paced_producer(belt: Belt[int], items: int) -> Callable[[Belt[int]], EndReason]:
    def target(b: Belt[int]) -> EndReason:
        for _ in range(items):
            b.put(time.perf_counter_ns())
            time.sleep(PACE_S)  # releases the GIL, as a native decode step does
        return EndReason.STOP

    return target


def _fast_producer(items: int) -> Callable[[Belt[int]], EndReason]:
    def target(b: Belt[int]) -> EndReason:
        for i in range(items):
            b.put(i)
        return EndReason.STOP

    return target


def _start(belt: Belt[int], target: Callable[[Belt[int]], EndReason]) -> threading.Thread:
    thread = threading.Thread(target=belt.produce, args=(target,), name="bench-producer")
    thread.start()
    return thread


def latency_sync(items: int) -> list[float]:
    """Put-to-receive latencies in µs, sync consumer on its own thread."""
    belt: Belt[int] = Belt(2)
    thread = _start(belt, _paced_producer(belt, items))
    out = [(time.perf_counter_ns() - sent) / 1000 for sent in belt]
    thread.join()
    return out


def latency_async(items: int) -> list[float]:
    """Put-to-receive latencies in µs, async consumer on an asyncio loop."""
    belt: Belt[int] = Belt(2)

    async def consume() -> list[float]:
        thread = _start(belt, _paced_producer(belt, items))
        try:
            return [(time.perf_counter_ns() - sent) / 1000 async for sent in belt]
        finally:
            thread.join()

    return _run(consume())


def floor_async(items: int) -> list[float]:
    """Paced latencies in µs of a bare ``call_soon_threadsafe`` -> future wake-up."""

    async def consume() -> list[float]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(items)]

        def produce() -> None:
            for fut in futures:
                loop.call_soon_threadsafe(fut.set_result, time.perf_counter_ns())
                time.sleep(PACE_S)

        thread = threading.Thread(target=produce, name="bench-floor")
        thread.start()
        out = []
        try:
            for fut in futures:
                sent = await fut
                out.append((time.perf_counter_ns() - sent) / 1000)
        finally:
            thread.join()
        return out

    return _run(consume())


def floor_sync(items: int) -> list[float]:
    """Paced latencies in µs of a bare ``threading.Condition`` hand-over."""
    cond = threading.Condition()
    box: list[int] = []

    def produce() -> None:
        for _ in range(items):
            with cond:
                box.append(time.perf_counter_ns())
                cond.notify()
            time.sleep(PACE_S)

    thread = threading.Thread(target=produce, name="bench-floor")
    thread.start()
    out = []
    for _ in range(items):
        with cond:
            cond.wait_for(lambda: bool(box))
            sent = box.pop()
        out.append((time.perf_counter_ns() - sent) / 1000)
    thread.join()
    return out


def throughput_sync(items: int) -> float:
    """Per-item cost in µs at full speed, sync consumer."""
    belt: Belt[int] = Belt(THROUGHPUT_CAPACITY)
    t0 = time.perf_counter()
    thread = _start(belt, _fast_producer(items))
    n = sum(1 for _ in belt)
    thread.join()
    assert n == items
    return (time.perf_counter() - t0) / items * 1e6


def throughput_async(items: int) -> float:
    """Per-item cost in µs at full speed, async consumer."""
    belt: Belt[int] = Belt(THROUGHPUT_CAPACITY)

    async def consume() -> float:
        t0 = time.perf_counter()
        thread = _start(belt, _fast_producer(items))
        try:
            n = 0
            async for _ in belt:
                n += 1
        finally:
            thread.join()
        assert n == items
        return (time.perf_counter() - t0) / items * 1e6

    return _run(consume())


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--items", type=int, default=20_000, help="items per measurement")
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="loop of async rows"
    )
    args = _harness.parse(parser, argv)
    items: int = args.items
    if items < 100:
        parser.error("--items must be >= 100")
    global _loop_factory
    if args.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            parser.error("--loop uvloop needs uvloop installed")
        _loop_factory = uvloop.new_event_loop

    # Warm up (imports, caches, CPU clocks) so the first row is not the odd one out.
    latency_async(max(100, items // 10))
    latency_sync(max(100, items // 10))

    lat_async = latency_async(items)
    lat_sync = latency_sync(items)
    base_async = floor_async(items)
    base_sync = floor_sync(items)
    tp_async = throughput_async(items)
    tp_sync = throughput_sync(items)

    result = {
        "items": items,
        "loop": args.loop,
        "pace_us": PACE_S * 1e6,
        "thread_to_async_median_us": round(statistics.median(lat_async), 2),
        "thread_to_async_p99_us": round(_harness.percentile(lat_async, 0.99), 2),
        "thread_to_sync_median_us": round(statistics.median(lat_sync), 2),
        "thread_to_sync_p99_us": round(_harness.percentile(lat_sync, 0.99), 2),
        "loop_floor_median_us": round(statistics.median(base_async), 2),
        "condition_floor_median_us": round(statistics.median(base_sync), 2),
        "thread_to_async_throughput_us_per_item": round(tp_async, 2),
        "thread_to_sync_throughput_us_per_item": round(tp_sync, 2),
        "python": sys.version.split()[0],
    }

    rows: list[tuple[str, str, str, list[float] | None, float | None]] = [
        ("thread -> async", "put-to-receive latency, paced", "median", lat_async, None),
        ("thread -> sync", "put-to-receive latency, paced", "median", lat_sync, None),
        ("floor, loop", "call_soon_threadsafe, no belt", "median", base_async, None),
        ("floor, threads", "Condition.notify, no belt", "median", base_sync, None),
        ("thread -> async", "wall time / items, full speed", "mean", None, tp_async),
        ("thread -> sync", "wall time / items, full speed", "mean", None, tp_sync),
    ]

    def table(result: dict[str, Any]) -> None:
        print(
            f"belt per-item overhead, {items} items per row, "
            f"{args.loop} loop, Python {result['python']}"
        )
        print()
        print(f"{'path':<16} {'measure':<32} {'stat':<7} {'µs':>8} {'p99 µs':>8}")
        for path, measure, stat, samples, value in rows:
            if samples is not None:
                mid = f"{statistics.median(samples):8.2f}"
                p99 = f"{_harness.percentile(samples, 0.99):8.2f}"
            else:
                mid, p99 = f"{value:8.2f}", f"{'':>8}"
            print(f"{path:<16} {measure:<32} {stat:<7} {mid} {p99}")

    _harness.emit(result, args.json, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
