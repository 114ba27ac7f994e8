"""Drive pairs of end causes against each other and check every request's story.

Used by ``tests/runtime/test_end_races.py`` (bounded in time) and
``benchmarks/races.py`` (as long as you like). Each request runs on its own model
of one scripted engine; two causes fire at the same point, each from the thread
it would come from in real use (the reader, another thread, the deadline timer,
the engine, the runtime). What must hold for every request:

- exactly one end reason, one of the two causes' (or the natural end, which may
  win any race), and the stream, its reply and its trace agree on it;
- the request is released, once, after its reason was recorded (the timeline
  invariants, checked on every event by ``tokenbelt.belt.invariants``);
- the metrics counted it once, under that reason;
- a stop is released within one step and a bound (``stop_released_in_time``), or the
  trace says why (the worker was killed for it).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenbelt import Limits, Runtime, ScriptedEngine
from tokenbelt._errors import DecodeError
from tokenbelt.belt import EndReason, Trace, invariants
from tokenbelt.runtime import Stream
from tokenbelt.server.core._metrics import Metrics

TOKENS = 4
#: how long past one engine step a stop may take to be released, here
STOP_BOUND_S = 0.5

#: cause -> the end reasons it may produce
CAUSES: dict[str, frozenset[EndReason]] = {
    "reader_stop": frozenset({EndReason.USER_CANCEL}),
    "cancel_thread": frozenset({EndReason.USER_CANCEL}),
    "disconnect": frozenset({EndReason.CLIENT_DISCONNECT}),
    "cancel_endpoint": frozenset({EndReason.USER_CANCEL}),
    "first_token_timeout": frozenset({EndReason.FIRST_TOKEN_TIMEOUT}),
    "total_timeout": frozenset({EndReason.TOTAL_TIMEOUT}),
    "stall_timeout": frozenset({EndReason.STALL_TIMEOUT}),
    "natural_end": frozenset({EndReason.STOP}),
    "engine_failure": frozenset({EndReason.RUNTIME_ERROR}),
    "shutdown": frozenset({EndReason.SHUTDOWN}),
    "unload": frozenset({EndReason.SHUTDOWN}),
}

PAIRS = list(itertools.combinations(CAUSES, 2))


@dataclass
class Outcome:
    requests: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


def _engine(causes: tuple[str, str], rng: random.Random) -> ScriptedEngine:
    tokens = [f" t{i}" for i in range(TOKENS)]
    fail_after = rng.randrange(TOKENS) if "engine_failure" in causes else None
    delay = 0.0005 if {"stall_timeout", "total_timeout"} & set(causes) else 0.0
    prefill = 0.001 if "first_token_timeout" in causes else 0.0
    return ScriptedEngine(tokens, delay=delay, prefill_delay=prefill, fail_after=fail_after)


#: the longest step of the scripted engines above (a token's delay, the prefill)
_STEP_S = 0.001


def _limits(causes: tuple[str, str]) -> Limits:
    return Limits(
        first_token=0.001 if "first_token_timeout" in causes else None,
        total=0.002 if "total_timeout" in causes else None,
        stall=0.0005 if "stall_timeout" in causes else None,
    )


def _fire(cause: str, rt: Runtime, name: str, stream: Stream) -> None:
    """One cause, from the thread it runs on."""
    if cause in ("cancel_thread", "cancel_endpoint"):
        stream.cancel(EndReason.USER_CANCEL)
    elif cause == "disconnect":
        stream.cancel(EndReason.CLIENT_DISCONNECT)
    elif cause == "shutdown":
        model = rt.models.get(name)  # gone if "unload" came first
        if model is not None:
            model.close()
    elif cause == "unload":
        with contextlib.suppress(Exception):  # the other cause may have unloaded it first
            rt.unload(name)


_HELPERS = frozenset({"cancel_thread", "disconnect", "cancel_endpoint", "shutdown", "unload"})


def one_request(
    rt: Runtime, causes: tuple[str, str], rng: random.Random, number: int, out: Outcome
) -> None:
    """Run one request with both causes aimed at the same point; record what happened."""
    # A few names, reused: each request's model is unloaded before the next one loads,
    # and a new name per request would grow the metrics by one label set per request
    # (and the heap, and with it the collector's pauses, past the stop bound).
    name = f"m{number % 8}"
    model = rt.add_engines(name, [_engine(causes, rng)])
    stream = model.stream(prompt="go", limits=_limits(causes), capacity=1, max_tokens=TOKENS + 1)
    helpers = [c for c in causes if c in _HELPERS]
    go = threading.Barrier(1 + len(helpers), timeout=10) if helpers else None
    threads = []
    for cause in helpers:

        def run(cause: str = cause) -> None:
            assert go is not None
            go.wait()
            _fire(cause, rt, name, stream)

        threads.append(threading.Thread(target=run, name=f"race-{cause}", daemon=True))
    for t in threads:
        t.start()

    def trigger() -> None:
        if go is not None:
            go.wait()

    at = rng.randrange(TOKENS)  # the causes fire before reading token number ``at``
    read, triggered, error = 0, False, None
    pieces = iter(stream)
    try:
        while True:
            if read == at and not triggered:
                triggered = True
                trigger()
                if "reader_stop" in causes:
                    stream.close()
                    break
            try:
                next(pieces)
            except StopIteration:
                break
            read += 1
    except DecodeError as exc:
        error = exc
    finally:
        pieces.close()  # type: ignore[attr-defined]
    if not triggered:
        trigger()
    for t in threads:
        t.join(10)
    _check(stream, causes, number, error, out, stopped="reader_stop" in causes)
    if name in rt.models:
        rt.unload(name)


def stop_released_in_time(
    trace: Trace | dict[str, Any], *, step_s: float, bound_s: float = STOP_BOUND_S
) -> str | None:
    """None if a stopped request was released within ``step_s + bound_s`` of its stop
    (or was never stopped), or if its trace says why not (a worker killed for it);
    else the problem. ``trace`` is a ``Trace`` or its ``to_dict()`` (``/v1/requests``)."""
    record = trace.to_dict() if isinstance(trace, Trace) else trace
    timeline = record["timeline_ms"]
    stopped, released = timeline["cancel_requested"], timeline["released"]
    if stopped is None:
        return None
    if released is None:
        return f"{record['request_id']}: stopped, never released"
    lag_s = (released - stopped) / 1000
    worker = record.get("worker") or {}
    if lag_s <= step_s + bound_s or "killed" in worker:
        return None
    return (
        f"{record['request_id']}: released {lag_s * 1000:.0f} ms after its stop "
        f"(bound {(step_s + bound_s) * 1000:.0f} ms) and the trace says nothing of why"
    )


def _check(
    stream: Stream,
    causes: tuple[str, str],
    number: int,
    error: BaseException | None,
    out: Outcome,
    *,
    stopped: bool,
) -> None:
    where = f"{causes[0]} x {causes[1]} #{number}"
    if not stream.wait_released(10):
        out.problem(f"{where}: not released")
    reason, trace = stream.end_reason, stream.trace
    out.requests += 1
    out.reasons[reason.value if reason else "none"] += 1
    allowed = CAUSES[causes[0]] | CAUSES[causes[1]] | {EndReason.STOP}
    if reason is None or trace.end_reason is not reason:
        out.problem(f"{where}: stream says {reason}, trace says {trace.end_reason}")
    elif reason not in allowed:
        out.problem(f"{where}: ended {reason.value}")
    elif reason is not EndReason.RUNTIME_ERROR and stream.reply().end_reason is not reason:
        out.problem(f"{where}: reply disagrees")
    # The reader gets the engine's error exactly when the request failed, unless it
    # stopped reading first (then it may never get that far).
    failed = reason is EndReason.RUNTIME_ERROR
    if (error is not None and not failed) or (failed and error is None and not stopped):
        out.problem(f"{where}: error {error!r} with {reason}")
    if trace.released is None:
        out.problem(f"{where}: the trace has no release")
    late = stop_released_in_time(trace, step_s=_STEP_S)
    if late is not None:
        out.problem(f"{where}: {late}")


def run(
    *,
    seconds: float,
    max_requests: int | None = None,
    seed: int = 0,
    pairs: list[tuple[str, str]] | None = None,
) -> tuple[Outcome, Counter[str]]:
    """Run pairs round robin until ``seconds`` pass or ``max_requests`` ran.

    Returns the outcome and the metrics' per-reason totals. The interpreter switches
    threads as often as it can while this runs. What the process held before (in a
    test worker: every module it ran) is moved out of the collector's sight for the
    run: a full collection over a test worker's heap took up to 215 ms here with 330,000
    objects, and one over a bigger heap on a busy machine held a release 1,041 ms past
    its stop; the bound is about tokenbelt's release path, not that heap.
    """
    rng = random.Random(seed)
    out = Outcome()
    metrics = Metrics(dict)
    old = sys.getswitchinterval()
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(1e-6)
    try:
        with Runtime(observers=[metrics.observe]) as rt:
            deadline = time.monotonic() + seconds
            for number, causes in enumerate(itertools.cycle(pairs or PAIRS)):
                if time.monotonic() >= deadline or number == max_requests:
                    break
                one_request(rt, causes, rng, number, out)
    finally:
        sys.setswitchinterval(old)
        gc.unfreeze()
    return out, metric_totals(metrics)


def metric_totals(metrics: Metrics) -> Counter[str]:
    totals: Counter[str] = Counter()
    for family in metrics.registry.collect():
        if family.name != "tokenbelt_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[sample.labels["end_reason"]] += int(sample.value)
    return totals


def summary(out: Outcome, totals: Counter[str]) -> Iterator[str]:
    yield f"requests: {out.requests}"
    for reason, n in sorted(out.reasons.items()):
        yield f"  {reason}: {n} (metrics {totals.get(reason, 0)})"
    yield f"invariant violations: {len(invariants.violations())}"
    yield f"problems: {len(out.problems)}"
    yield from (f"  {p}" for p in out.problems)
