"""``tokenbelt demo``: the belt experiment, with a scripted kitchen and a slow guest."""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass

from .._errors import InvalidArgument
from ..belt import Belt, EndReason, check_capacity, check_duration
from ..engines import GenerationRequest, SamplingParams, ScriptedEngine
from ._common import Parser, counted, non_negative_int

#: how many tokens the scripted producer has: --limit cannot ask for more
SCRIPT_TOKENS = 1000

LEGEND = """\
time: since the start; token: what the consumer read; belt: tokens waiting / capacity
produced: tokens the producer made; consumed: tokens read; buffer peak: most waiting at once
end reason: user_cancel when the consumer stopped at --limit, stop when the script ran out
cancel to release: from the consumer's stop to the producer letting go (— if nothing stopped)"""


def _limit(text: str) -> int:
    value = non_negative_int(text)
    if value > SCRIPT_TOKENS:
        raise argparse.ArgumentTypeError(
            f"the scripted producer has {SCRIPT_TOKENS} tokens; ask for at most that many, "
            f"got {value}"
        )
    return value


def _milliseconds(text: str) -> float:
    """Both *-ms flags: a finite number of milliseconds >= 0 (0 = no wait at all)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"milliseconds must be a number >= 0, got {text!r}"
        ) from None
    try:
        check_duration("value", value)
    except InvalidArgument:
        raise argparse.ArgumentTypeError(
            f"milliseconds must be a finite number >= 0 (0 = no wait), got {text}"
        ) from None
    return value


@dataclass(frozen=True)
class DemoSummary:
    produced: int
    consumed: int
    buffer_peak: int
    end_reason: str
    cancel_to_release_ms: float | None


def run_demo(
    *,
    capacity: int = 2,
    limit: int = 5,
    produce_ms: float = 10.0,
    consume_ms: float = 30.0,
    tokens: int = SCRIPT_TOKENS,
    echo: bool = True,
) -> DemoSummary:
    """Run a fast producer against a slow consumer that stops after ``limit`` tokens.

    Prints one line per token read (time, token, belt fill) when ``echo`` is set.
    Raises ``InvalidArgument`` for a bad size or duration.
    """
    check_capacity(capacity)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InvalidArgument(f"limit must be an integer >= 0, got {limit!r}")
    if limit > tokens:
        raise InvalidArgument(f"limit must be at most the {tokens} scripted tokens, got {limit}")
    produce_s = (check_duration("produce_ms", produce_ms) or 0.0) / 1000
    consume_s = (check_duration("consume_ms", consume_ms) or 0.0) / 1000

    engine = ScriptedEngine([f"tok{i}" for i in range(tokens)], delay=produce_s)
    belt: Belt[str] = Belt(capacity)
    request = GenerationRequest(prompt="demo", sampling=SamplingParams(max_tokens=tokens))
    belt.trace.mark_enqueued()
    producer = threading.Thread(
        target=belt.produce,
        args=(lambda b: engine.generate(request, b.producer),),
        name="tokenbelt-demo-producer",
    )
    start = time.monotonic()
    producer.start()
    try:
        for count, token in enumerate(belt if limit > 0 else (), start=1):
            fill = belt.statistics().buffered
            if echo:
                elapsed = (time.monotonic() - start) * 1000
                print(f"{elapsed:8.1f} ms  {token:<8} belt {fill}/{capacity}")
            if count >= limit:
                break
            time.sleep(consume_s)
    finally:
        belt.close()
        producer.join()
    stats = belt.statistics()
    ctr = belt.trace.cancel_to_release
    return DemoSummary(
        produced=stats.produced,
        consumed=stats.consumed,
        buffer_peak=stats.peak,
        end_reason=(belt.end_reason or EndReason.STOP).value,
        cancel_to_release_ms=None if ctr is None else round(ctr * 1000, 3),
    )


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the belt experiment: a fast producer, a slow consumer that stops early",
        description="A fast scripted producer, a slow consumer, a bounded belt between them.",
    )
    p.add_argument("--capacity", type=counted("capacity"), default=2, help="belt capacity (>= 1)")
    p.add_argument(
        "--limit",
        type=_limit,
        default=5,
        help=f"tokens read before the consumer stops (0..{SCRIPT_TOKENS})",
    )
    p.add_argument(
        "--produce-ms", type=_milliseconds, default=10.0, help="ms per produced token (>= 0)"
    )
    p.add_argument(
        "--consume-ms", type=_milliseconds, default=30.0, help="ms per consumed token (>= 0)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    summary = run_demo(
        capacity=args.capacity,
        limit=args.limit,
        produce_ms=args.produce_ms,
        consume_ms=args.consume_ms,
        echo=not args.json,
    )
    if args.json:
        print(json.dumps(asdict(summary)))
        return 0
    ctr = summary.cancel_to_release_ms
    print()
    print(f"produced             {summary.produced}")
    print(f"consumed             {summary.consumed}")
    print(f"buffer peak          {summary.buffer_peak}")
    print(f"end reason           {summary.end_reason}")
    print(f"cancel to release    {'—' if ctr is None else f'{ctr} ms'}")
    print()
    print(LEGEND)
    return 0
