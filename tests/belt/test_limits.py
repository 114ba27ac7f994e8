"""Limits (relative seconds) and the deadlines they become on a belt, with a fake clock."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from tokenbelt import Cancelled, EndOfStream, InvalidArgument
from tokenbelt.belt import (
    MAX_DURATION_S,
    Belt,
    Deadlines,
    EndReason,
    Limits,
    Trace,
    check_capacity,
    check_duration,
)


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


BAD_DURATIONS = [float("nan"), float("inf"), -float("inf"), -1, -0.001, True, "1", [1]]


@pytest.mark.parametrize("field", ["first_token", "total", "stall", "load"])
@pytest.mark.parametrize("value", [*BAD_DURATIONS, 0, 0.0], ids=repr)
def test_limits_reject_bad_values(field: str, value: Any) -> None:
    with pytest.raises(InvalidArgument, match=f"Limits.{field}"):
        Limits(**{field: value})


def test_limits_bad_values_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"Limits\.total must be a number more than 0"):
        Limits(total=float("nan"))
    with pytest.raises(ValueError, match=r"Limits\.first_token must be a number more than 0"):
        Limits(first_token=-1)


def test_limits_accept_positive_numbers_and_none() -> None:
    limits = Limits(first_token=1, total=2.5, stall=0.1)
    assert (limits.first_token, limits.total, limits.stall, limits.load) == (1, 2.5, 0.1, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.total = 3  # type: ignore[misc]


def test_limits_become_absolute_deadlines() -> None:
    assert Limits(first_token=2, total=10, stall=0.5).deadlines(now=100.0) == Deadlines(
        first_token=102.0, total=110.0, stall=0.5
    )
    assert Limits().deadlines(now=100.0) == Deadlines()


@pytest.mark.parametrize("value", BAD_DURATIONS, ids=repr)
def test_check_duration_rejects(value: Any) -> None:
    with pytest.raises(InvalidArgument, match="delay"):
        check_duration("delay", value)


def test_a_duration_past_a_year_is_refused_naming_the_range() -> None:
    """Past a year no timer can wait: ``threading`` raised ``OverflowError`` on the
    thread that waited (a reader's, the deadline timer's), which died of it."""
    assert check_duration("x", MAX_DURATION_S) == MAX_DURATION_S
    for value in (MAX_DURATION_S + 1, 1e15, 1e300):
        with pytest.raises(InvalidArgument, match=r"x must be a number from 0 to 31536000 seconds"):
            check_duration("x", value)
    with pytest.raises(InvalidArgument, match="at most 31536000 seconds"):
        Limits(total=1e300)


def test_check_duration_zero_and_none() -> None:
    assert check_duration("d", None) is None
    assert check_duration("d", 0) == 0.0
    assert check_duration("d", 3) == 3.0
    with pytest.raises(InvalidArgument, match="d must be a number more than 0"):
        check_duration("d", 0, allow_zero=False)
    assert not math.isnan(check_duration("d", 1e-9) or 0.0)


@pytest.mark.parametrize("value", [0, -1, True, False, 1.0, "1", None])
def test_check_capacity_rejects(value: Any) -> None:
    with pytest.raises(InvalidArgument, match="slots must be an integer from 1 to 256"):
        check_capacity(value, name="slots")


# -- deadlines on a belt, driven by a fake clock ----------------------------------------------


def belt_at(clock: FakeClock, deadlines: Deadlines, capacity: int = 4) -> Belt[str]:
    return Belt(capacity, deadlines=deadlines, trace=Trace(clock=clock))


def expect_end(belt: Belt[str], reason: EndReason) -> None:
    with pytest.raises(Cancelled) as exc:
        belt.checkpoint()
    assert exc.value.reason is reason
    assert belt.end_reason is reason
    assert belt.trace.end_reason is reason
    assert belt.trace.cancel_requested is not None


def test_first_token_deadline() -> None:
    clock = FakeClock()
    belt = belt_at(clock, Deadlines(first_token=10.0))
    clock.now = 9.999
    belt.checkpoint()
    clock.now = 10.0
    expect_end(belt, EndReason.FIRST_TOKEN_TIMEOUT)


def test_first_token_deadline_is_disarmed_by_the_first_token() -> None:
    clock = FakeClock()
    belt = belt_at(clock, Deadlines(first_token=10.0))
    clock.now = 5.0
    belt.put("a")
    clock.now = 1000.0
    belt.checkpoint()
    assert belt.end_reason is None


def test_total_deadline() -> None:
    clock = FakeClock()
    belt = belt_at(clock, Deadlines(total=10.0))
    clock.now = 5.0
    belt.put("a")
    clock.now = 9.9
    belt.checkpoint()
    clock.now = 10.0
    expect_end(belt, EndReason.TOTAL_TIMEOUT)


def test_stall_deadline_is_armed_by_start_and_moves_with_each_item() -> None:
    clock = FakeClock()
    belt = belt_at(clock, Deadlines(stall=3.0))
    clock.now = 100.0
    belt.checkpoint()  # not started: no stall clock yet
    belt.start()
    clock.now = 102.9
    belt.checkpoint()
    belt.put("a")  # the gap restarts at 102.9
    clock.now = 105.8
    belt.checkpoint()
    clock.now = 105.9
    expect_end(belt, EndReason.STALL_TIMEOUT)


def test_stall_deadline_starts_at_the_first_item() -> None:
    # The prefill before the first item is first_token's to bound, however long it is.
    clock = FakeClock()
    belt = belt_at(clock, Deadlines(stall=3.0))
    belt.start()
    clock.now = 1000.0
    belt.checkpoint()
    assert belt.end_reason is None
    belt.put("a")
    clock.now = 1002.999
    belt.checkpoint()
    clock.now = 1003.0
    expect_end(belt, EndReason.STALL_TIMEOUT)


def test_stall_does_not_count_time_waiting_on_a_full_belt() -> None:
    # A slow reader pauses the producer; that is backpressure, not a stalled engine.
    clock = FakeClock()
    belt = belt_at(clock, Deadlines(stall=3.0), capacity=1)
    belt.start()
    belt.put("a")  # full
    clock.now = 1000.0
    belt.checkpoint()
    assert belt.end_reason is None
    assert belt.get() == "a"  # room again: the stall clock restarts now
    clock.now = 1002.9
    belt.checkpoint()
    clock.now = 1003.0
    expect_end(belt, EndReason.STALL_TIMEOUT)


def test_earliest_deadline_wins() -> None:
    clock = FakeClock()
    belt = belt_at(clock, Deadlines(first_token=5.0, total=3.0))
    clock.now = 6.0
    expect_end(belt, EndReason.TOTAL_TIMEOUT)


def test_an_expired_deadline_ends_a_waiting_consumer_at_once() -> None:
    clock = FakeClock(50.0)
    belt = belt_at(clock, Deadlines(total=10.0))
    with pytest.raises(EndOfStream) as exc:
        belt.get()
    assert exc.value.reason is EndReason.TOTAL_TIMEOUT


def test_deadlines_stop_counting_after_the_end() -> None:
    clock = FakeClock()
    belt = belt_at(clock, Deadlines(total=10.0))
    belt.put("a")
    belt.finish()
    clock.now = 100.0
    assert belt.get() == "a"  # a natural end keeps its items; the deadline is moot
    assert belt.end_reason is EndReason.STOP
