"""The request trace: marks, derived durations, JSON, observers, the release-lag alert."""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest

from tokenbelt.belt import (
    DEFAULT_RELEASE_LAG_THRESHOLD,
    Belt,
    EndReason,
    Trace,
    TraceEvent,
    new_request_id,
)

NET = 5.0


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def full_trace() -> Trace:
    trace = Trace("req_test", model="scripted", clock=FakeClock())
    trace.mark_enqueued(at=10.0)
    trace.mark_admitted(at=10.5)
    trace.mark_token(at=11.0)
    trace.mark_token(at=12.0)
    trace.mark_token(at=13.0)
    trace.prompt_tokens = 7
    trace.completion_tokens = 5
    trace.buffer_peak = 2
    trace.mark_cancel_requested(at=13.5)
    trace.mark_ended(EndReason.USER_CANCEL)
    trace.mark_released(at=13.7)
    return trace


def test_derived_durations() -> None:
    trace = full_trace()
    assert trace.queue_wait == pytest.approx(0.5)
    assert trace.time_to_first_token == pytest.approx(1.0)
    assert trace.first_token == 11.0
    assert trace.last_token == 13.0
    assert trace.decode_rate == pytest.approx((5 - 1) / 2.0)
    assert trace.cancel_to_release == pytest.approx(0.2)
    assert trace.end_to_end == pytest.approx(3.7)
    assert trace.end_reason is EndReason.USER_CANCEL
    assert not trace.release_lagged


def test_durations_are_none_until_both_ends_are_known() -> None:
    trace = Trace(clock=FakeClock())
    assert trace.queue_wait is None
    assert trace.time_to_first_token is None
    assert trace.cancel_to_release is None
    assert trace.end_to_end is None
    assert trace.decode_rate is None
    trace.mark_enqueued(at=1.0)
    trace.mark_token(at=2.0)
    trace.completion_tokens = 1
    assert trace.time_to_first_token == pytest.approx(1.0)
    assert trace.decode_rate is None  # one token has no rate


def test_marks_are_set_once_and_end_reason_once() -> None:
    trace = Trace(clock=FakeClock())
    trace.mark_enqueued(at=1.0)
    trace.mark_enqueued(at=2.0)
    trace.mark_admitted(at=3.0)
    trace.mark_admitted(at=4.0)
    assert (trace.enqueued, trace.admitted) == (1.0, 3.0)
    assert trace.mark_ended(EndReason.STOP) is True
    assert trace.mark_ended(EndReason.USER_CANCEL, RuntimeError("x")) is False
    assert trace.end_reason is EndReason.STOP
    assert trace.error is None


def test_mark_token_sets_first_once_and_last_always() -> None:
    trace = Trace(clock=FakeClock(50.0))
    trace.mark_token()
    trace.mark_token(at=60.0)
    assert (trace.first_token, trace.last_token) == (50.0, 60.0)


def test_mark_ended_records_the_error() -> None:
    trace = Trace()
    trace.mark_ended(EndReason.RUNTIME_ERROR, ValueError("bad logits"))
    assert trace.error == "ValueError: bad logits"


def test_to_dict_is_json_serialisable() -> None:
    trace = full_trace()
    data = trace.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["request_id"] == "req_test"
    assert data["model"] == "scripted"
    assert data["timeline_ms"] == {
        "enqueued": 0.0,
        "admitted": 500.0,
        "first_token": 1000.0,
        "last_token": 3000.0,
        "cancel_requested": 3500.0,
        "released": 3700.0,
    }
    assert data["queue_wait_ms"] == pytest.approx(500.0)
    assert data["time_to_first_token_ms"] == pytest.approx(1000.0)
    assert data["cancel_to_release_ms"] == pytest.approx(200.0)
    assert data["end_to_end_ms"] == pytest.approx(3700.0)
    assert data["decode_tok_s"] == pytest.approx(2.0)
    assert (data["prompt_tokens"], data["completion_tokens"], data["buffer_peak"]) == (7, 5, 2)
    assert data["end_reason"] == "user_cancel"
    assert data["error"] is None
    assert data["release_lagged"] is False
    assert isinstance(data["enqueued_at"], float)


def test_to_dict_of_an_empty_trace() -> None:
    data = Trace().to_dict()
    json.dumps(data)
    assert data["enqueued_at"] is None
    assert set(data["timeline_ms"].values()) == {None}
    assert data["end_reason"] is None


def test_to_dict_of_a_real_run_serialises() -> None:
    belt: Belt[str] = Belt(2)
    belt.trace.mark_enqueued()

    def target(b: Belt[str]) -> EndReason:
        b.put("a")
        b.trace.completion_tokens += 1
        raise KeyError("missing")

    belt.produce(target)
    data = json.loads(json.dumps(belt.trace.to_dict()))
    assert data["end_reason"] == "runtime_error"
    assert data["error"] == "KeyError: 'missing'"
    assert data["buffer_peak"] == 1
    assert all(
        data["timeline_ms"][k] is not None
        for k in ("enqueued", "admitted", "first_token", "last_token", "released")
    )
    assert data["timeline_ms"]["cancel_requested"] is None


def test_observers_get_events_in_order() -> None:
    seen: list[tuple[str, float]] = []
    early: list[str] = []
    trace = Trace(clock=FakeClock(), observers=[lambda e: early.append(e.kind)])
    trace.subscribe(lambda e: seen.append((e.kind, e.at)))
    trace.mark_enqueued(at=1.0)
    trace.mark_admitted(at=2.0)
    trace.mark_token(at=3.0)
    trace.mark_token(at=4.0)  # not the first: no event
    trace.mark_cancel_requested(at=5.0)
    trace.mark_ended(EndReason.USER_CANCEL)
    trace.mark_released(at=5.5)
    trace.mark_released(at=6.0)  # already released: no event
    kinds = ["enqueued", "admitted", "first_token", "cancel_requested", "ended", "released"]
    assert [k for k, _ in seen] == kinds
    assert early == kinds
    assert [at for _, at in seen if _ != "ended"] == [1.0, 2.0, 3.0, 5.0, 5.5]


def test_event_carries_its_trace() -> None:
    events: list[TraceEvent] = []
    trace = Trace(observers=(events.append,))
    trace.mark_admitted()
    assert events[0].trace is trace
    assert events[0].kind == "admitted"


def test_failing_observer_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def broken(event: TraceEvent) -> None:
        raise RuntimeError("observer bug")

    trace = Trace(observers=[broken, lambda e: seen.append(e.kind)])
    with caplog.at_level(logging.ERROR, logger="tokenbelt.trace"):
        trace.mark_enqueued()
    assert seen == ["enqueued"]
    assert "failed on enqueued" in caplog.text


def test_belt_run_emits_lifecycle_in_order() -> None:
    kinds: list[str] = []
    belt: Belt[int] = Belt(1, trace=Trace(observers=[lambda e: kinds.append(e.kind)]))
    belt.trace.mark_enqueued()

    def target(b: Belt[int]) -> EndReason:
        b.put(1)
        b.cancel(EndReason.CLIENT_DISCONNECT)
        b.checkpoint()
        raise AssertionError("checkpoint did not raise")

    belt.produce(target)
    assert kinds == ["enqueued", "admitted", "first_token", "cancel_requested", "ended", "released"]
    assert belt.trace.end_reason is EndReason.CLIENT_DISCONNECT


# -- release lag ----------------------------------------------------------------------------


def test_release_lagging_cancel_emits_release_lag(caplog: pytest.LogCaptureFixture) -> None:
    lag_events: list[TraceEvent] = []
    trace = Trace("req_lag", clock=FakeClock(), observers=[lag_events.append])
    trace.mark_cancel_requested(at=100.0)
    trace.mark_ended(EndReason.USER_CANCEL)
    with caplog.at_level(logging.WARNING, logger="tokenbelt.trace"):
        trace.mark_released(at=100.0 + DEFAULT_RELEASE_LAG_THRESHOLD + 0.5)
    assert [e.kind for e in lag_events] == [
        "cancel_requested",
        "ended",
        "released",
        "release_lag",
    ]
    assert trace.release_lagged
    assert trace.to_dict()["release_lagged"] is True
    assert re.search(r"req_lag released 1500 ms after", caplog.text)


def test_a_stop_never_released_alerts_without_waiting_for_the_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hung engine never releases; the alert must not depend on a release coming."""
    alerted = threading.Event()
    kinds: list[str] = []

    def observe(event: TraceEvent) -> None:
        kinds.append(event.kind)
        if event.kind == "release_lag":
            alerted.set()

    trace = Trace("req_hung", observers=[observe], release_lag_threshold=0.05)
    with caplog.at_level(logging.WARNING, logger="tokenbelt.trace"):
        trace.mark_cancel_requested()
        assert alerted.wait(10), "no release_lag for a stop that was never released"
    assert trace.released is None
    assert trace.release_lagged
    assert re.search(r"req_hung still not released \d+ ms after its stop", caplog.text)
    trace.mark_ended(EndReason.USER_CANCEL)
    trace.mark_released()  # late: the alert is not raised twice
    assert kinds == ["cancel_requested", "release_lag", "ended", "released"]


def test_release_within_threshold_is_not_an_alert() -> None:
    lag_events: list[TraceEvent] = []
    trace = Trace(clock=FakeClock(), observers=[lag_events.append])
    trace.mark_cancel_requested(at=100.0)
    trace.mark_ended(EndReason.USER_CANCEL)
    trace.mark_released(at=100.0 + DEFAULT_RELEASE_LAG_THRESHOLD - 0.1)
    assert "release_lag" not in [e.kind for e in lag_events]
    assert not trace.release_lagged


def test_release_lag_threshold_is_configurable() -> None:
    lag_events: list[TraceEvent] = []
    trace = Trace(clock=FakeClock(), observers=[lag_events.append], release_lag_threshold=0.05)
    trace.mark_cancel_requested(at=100.0)
    trace.mark_ended(EndReason.USER_CANCEL)
    trace.mark_released(at=100.2)
    assert [e.kind for e in lag_events][-1] == "release_lag"


def test_slow_release_after_a_natural_end_is_not_an_alert() -> None:
    lag_events: list[TraceEvent] = []
    trace = Trace(clock=FakeClock(), observers=[lag_events.append])
    trace.mark_token(at=1.0)
    trace.mark_ended(EndReason.STOP)
    trace.mark_released(at=60.0)  # no stop was asked for, so nothing lagged behind one
    assert "release_lag" not in [e.kind for e in lag_events]


def test_wait_released_wakes_on_release_from_another_thread() -> None:
    trace = Trace()
    trace.mark_ended(EndReason.STOP)
    assert trace.wait_released(0) is False
    releaser = threading.Thread(target=trace.mark_released, name="test-releaser")
    releaser.start()
    assert trace.wait_released(NET) is True
    releaser.join(NET)


# -- ids and reasons ------------------------------------------------------------------------


def test_request_ids_are_unique_and_url_safe() -> None:
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"req_[0-9a-f]{16}", i) for i in ids)
    assert re.fullmatch(r"req_[0-9a-f]{16}", Trace().request_id)


def test_end_reasons() -> None:
    assert {r.value for r in EndReason} == {
        "stop",
        "length",
        "user_cancel",
        "client_disconnect",
        "superseded",
        "reader_timeout",
        "first_token_timeout",
        "total_timeout",
        "stall_timeout",
        "load_timeout",
        "rejected",
        "runtime_error",
        "shutdown",
    }
    assert {r for r in EndReason if r.is_natural} == {EndReason.STOP, EndReason.LENGTH}
    assert {r for r in EndReason if r.is_timeout} == {
        EndReason.FIRST_TOKEN_TIMEOUT,
        EndReason.TOTAL_TIMEOUT,
        EndReason.STALL_TIMEOUT,
        EndReason.LOAD_TIMEOUT,
    }
    assert EndReason.LENGTH.openai_finish_reason == "length"
    # Only OpenAI's own values: a caller's stop is "stop", any other early end "length".
    assert EndReason.USER_CANCEL.openai_finish_reason == "stop"
    assert EndReason.CLIENT_DISCONNECT.openai_finish_reason == "stop"
    # The caller sent the request that replaced it (the next keystroke's completion).
    assert EndReason.SUPERSEDED.openai_finish_reason == "stop"
    for reason in EndReason:
        assert reason.openai_finish_reason in {"stop", "length"}
        if reason.is_timeout or reason in (EndReason.SHUTDOWN, EndReason.RUNTIME_ERROR):
            assert reason.openai_finish_reason == "length"
    # A reader that took nothing left, as a disconnect does: not a deadline.
    assert EndReason.READER_TIMEOUT.openai_finish_reason == "stop"
    assert json.dumps(EndReason.STOP) == '"stop"'


def test_tokens_after_stop_are_those_read_and_generated_after_the_stop() -> None:
    """A step in flight at the stop ends after it: its prompt chunk and any token it
    yields were computed for a request nobody waits for."""
    belt: Belt[str] = Belt(4)
    trace = belt.trace
    trace.prompt_tokens = 300
    trace.cached_tokens = trace.prompt_read = 40  # the prefix cache's, not computed
    trace.prompt_read = 168
    assert trace.tokens_after_stop == 0  # no stop yet
    assert belt.cancel(EndReason.SUPERSEDED)
    trace.prompt_read = 296  # the chunk in flight
    trace.completion_tokens += 1
    assert trace.tokens_after_stop == 128 + 1
    assert trace.to_dict()["tokens_after_stop"] == 129


def test_cells_the_prefix_cache_gives_after_a_stop_are_not_computed() -> None:
    belt: Belt[str] = Belt(4)
    belt.cancel(EndReason.CLIENT_DISCONNECT)  # before the engine looked at the prompt
    belt.trace.cached_tokens = belt.trace.prompt_read = 90
    assert belt.trace.tokens_after_stop == 0
    belt.trace.prompt_read = 100
    assert belt.trace.tokens_after_stop == 10


def test_a_natural_end_has_no_tokens_after_a_stop() -> None:
    belt: Belt[str] = Belt(4)
    belt.trace.prompt_read = 5
    belt.finish(EndReason.LENGTH)
    belt.trace.completion_tokens = 3
    assert belt.trace.tokens_after_stop == 0
    assert belt.trace.to_dict()["infill"] is False
