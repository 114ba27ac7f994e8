"""Exactly one end reason under every interleaving: the stress run and forced races."""

from __future__ import annotations

import os
import threading
import time

import pytest

import races
from tokenbelt.belt import Belt, EndReason, TraceEvent, invariants

# CI keeps this short; ``benchmarks/races.py --seconds N`` runs as long as you like.
STRESS_SECONDS = float(os.environ.get("TOKENBELT_STRESS_SECONDS", "25"))


@pytest.mark.timeout(STRESS_SECONDS + 60)
def test_every_pair_of_end_causes_keeps_one_reason_per_request() -> None:
    out, totals = races.run(seconds=STRESS_SECONDS)
    report = "\n".join(races.summary(out, totals))
    assert out.requests >= len(races.PAIRS), report  # every pair ran at least once
    assert not out.problems, report
    assert not invariants.violations(), report
    assert sum(out.reasons.values()) == out.requests
    # The metrics counted every request once, under the reason its trace holds.
    assert dict(totals) == dict(out.reasons), report


def test_a_stop_seen_by_the_producer_is_already_in_the_trace() -> None:
    """Force the race of issue 17: the canceller pauses right after its stop became
    visible; the producer sees the stop and releases meanwhile. Every observer still
    gets the reason before the release, and the release carries it."""
    belt: Belt[str] = Belt(1)
    seen: list[tuple[str, str | None]] = []
    producer_done = threading.Event()

    def observer(event: TraceEvent) -> None:
        reason = event.trace.end_reason
        seen.append((event.kind, None if reason is None else reason.value))
        if event.kind == "cancel_requested":
            # The injected pause: hold the cancelling thread until the producer, which
            # can already see the cancel, has recorded its release.
            deadline = time.monotonic() + 5
            while event.trace.released is None and time.monotonic() < deadline:
                time.sleep(0.001)
            assert event.trace.released is not None

    belt.trace.subscribe(observer)

    def produce() -> None:
        try:
            while True:
                belt.put("x")
        except Exception:
            pass
        belt.release()
        producer_done.set()

    belt.start()
    t = threading.Thread(target=produce, name="race-producer")
    t.start()
    assert belt.get() == "x"
    belt.cancel(EndReason.USER_CANCEL)
    t.join(5)
    assert producer_done.is_set()
    kinds = [k for k, _ in seen]
    assert kinds.index("ended") < kinds.index("released")
    assert dict(seen)["released"] == "user_cancel"
    assert not invariants.violations()


def test_natural_end_and_release_reach_observers_in_order_across_threads() -> None:
    """A slow observer of ``ended`` on the producer thread does not let a reader's
    late cancel or the release overtake it: one order for every observer."""
    belt: Belt[str] = Belt(2)
    order: list[str] = []
    gate, in_ended = threading.Event(), threading.Event()

    def observer(event: TraceEvent) -> None:
        order.append(event.kind)
        if event.kind == "ended":
            in_ended.set()
            gate.wait(5)

    belt.trace.subscribe(observer)
    t = threading.Thread(
        target=belt.produce, args=(lambda b: EndReason.LENGTH,), name="race-finisher"
    )
    t.start()
    assert in_ended.wait(5)  # the producer is delivering ``ended``, not yet released
    assert belt.cancel(EndReason.USER_CANCEL) is False  # the natural end won
    gate.set()
    t.join(5)
    assert belt.released
    assert order == ["admitted", "ended", "released"]
    assert belt.trace.cancel_requested is None
    assert belt.trace.end_reason is EndReason.LENGTH
