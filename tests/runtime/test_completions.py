"""A model's completion statistics: what it counts of released traces, and what not."""

from __future__ import annotations

from tokenbelt.belt import EndReason, Trace, TraceEvent
from tokenbelt.runtime import CompletionStatistics
from tokenbelt.runtime._completions import WINDOW, CompletionTally


def released(
    reason: EndReason,
    *,
    infill: bool = True,
    first: float | None = 0.05,
    after_stop: int = 0,
) -> TraceEvent:
    """The release of a request that ended ``reason``: its first token ``first`` seconds
    after its enqueue, ``after_stop`` tokens generated after a stop (if it had one)."""
    trace = Trace()
    trace.infill = infill
    trace.mark_enqueued(at=0.0)
    if first is not None:
        trace.mark_token(at=first)
    trace.completion_tokens = 2
    trace.record_end(reason, cancel_at=9.0 if reason.is_cancel else None)
    trace.completion_tokens += after_stop
    trace.mark_released(at=10.0)
    return TraceEvent("released", trace, 10.0)


def test_superseded_stale_tokens_and_first_tokens_are_counted_at_the_release() -> None:
    tally = CompletionTally()
    for event in (
        released(EndReason.SUPERSEDED, after_stop=1),
        released(EndReason.SUPERSEDED, first=None),  # superseded in the queue
        released(EndReason.CLIENT_DISCONNECT, first=0.2, after_stop=2),
        released(EndReason.LENGTH, first=0.01),
        released(EndReason.USER_CANCEL, infill=False, after_stop=5),  # not stale: a Stop
        released(EndReason.STOP, infill=False, first=0.9),  # a chat: no keystroke
    ):
        tally.observe(TraceEvent("first_token", event.trace, 0.0))  # only releases count
        tally.observe(event)
    assert tally.statistics() == CompletionStatistics(
        completions=4,
        superseded=2,
        stale_tokens=3,
        first_token_p50=0.05,
        first_token_p95=0.2,
    )
    assert tally.statistics().to_dict() == {
        "completions": 4,
        "superseded": 2,
        "stale_tokens": 3,
        "first_token_p50_ms": 50.0,
        "first_token_p95_ms": 200.0,
    }


def test_the_percentiles_are_of_the_latest_completions_and_none_before_any() -> None:
    tally = CompletionTally()
    assert tally.statistics().first_token_p50 is None
    assert tally.statistics().to_dict()["first_token_p95_ms"] is None
    for _ in range(WINDOW):
        tally.observe(released(EndReason.LENGTH, first=5.0))
    for _ in range(WINDOW):
        tally.observe(released(EndReason.LENGTH, first=0.5))
    stats = tally.statistics()
    assert stats.completions == 2 * WINDOW
    assert stats.first_token_p95 == 0.5
