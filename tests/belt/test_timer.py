"""The deadline timer: one thread per runtime that no failing expiry can end."""

from __future__ import annotations

import threading
import time

import pytest

from tokenbelt.belt import DeadlineTimer


class _Failing:
    def expire(self) -> float | None:
        raise RuntimeError("a cancel callback failed")


class _Counting:
    def __init__(self) -> None:
        self.fired = threading.Event()

    def expire(self) -> float | None:
        self.fired.set()
        return None


def test_a_failing_expiry_is_reported_and_the_timer_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    timer = DeadlineTimer(name="tokenbelt-test-deadlines")
    try:
        failing, counting = _Failing(), _Counting()
        now = time.monotonic()
        timer.schedule(failing, now)
        timer.schedule(counting, now + 0.05)
        # The deadline after the failing one still fires: the thread lived on.
        assert counting.fired.wait(10.0)
        assert timer.failures == 1
        assert "the deadline timer goes on" in caplog.text
    finally:
        timer.close()
