"""A background thread whose work fails once says so and goes on doing its duty.

The deadline timer's loop, a model's keep-alive timer and a remote engine's health
checks, each made to fail once: the failure is logged (with its traceback) and counted,
and the next deadline still fires, the next keep-alive still unloads, the next round of
checks still runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tokenbelt import EndReason, Limits, ModelState, Runtime, ScriptedEngine
from tokenbelt.engines.remote import RemoteEngine, Upstream

from . import NET, wait_until


def _fails_once(real: Callable[..., Any], error: str) -> Callable[..., Any]:
    failed: list[bool] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(True)
            raise RuntimeError(error)
        return real(*args, **kwargs)

    return call


def test_a_deadline_timer_whose_loop_fails_is_logged_and_its_deadlines_still_fire(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with Runtime(keep_alive=None) as rt:
        # A prefill that never ends on its own: only the timer can end the request.
        model = rt.add_engines("prefill", [ScriptedEngine(["never"], prefill_delay=NET)])
        timer = model._timer
        timer._clock = _fails_once(time.monotonic, "the clock failed")
        with caplog.at_level(logging.ERROR, logger="tokenbelt.deadlines"):
            first = model.stream(prompt="hi", limits=Limits(first_token=0.05))
            assert list(first) == []
            assert first.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
            assert first.wait_released(NET)
        assert timer.restarts == 1
        failures = [r for r in caplog.records if "deadline timer failed" in r.getMessage()]
        assert len(failures) == 1
        assert failures[0].exc_info is not None
        # The timer lives on for the next request's deadline too.
        second = model.stream(prompt="hi", limits=Limits(first_token=0.05))
        assert list(second) == []
        assert second.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
        assert timer.restarts == 1


def test_a_keep_alive_timer_that_fails_is_logged_and_a_later_one_still_unloads(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[ScriptedEngine] = []

    def factory() -> list[ScriptedEngine]:
        made.append(ScriptedEngine(["hello"], delay=0))
        return made[-1:]

    with Runtime(keep_alive=None) as rt:
        model = rt.add_engines("scripted", factory)
        monkeypatch.setattr(
            model, "_unload_if_idle", _fails_once(model._unload_if_idle, "the unload failed")
        )
        with caplog.at_level(logging.ERROR, logger="tokenbelt.runtime"):
            model.set_keep_alive(0.05)
            wait_until(lambda: model.state is ModelState.IDLE_UNLOADED, "the idle unload")
        failures = [r for r in caplog.records if "keep-alive timer" in r.getMessage()]
        assert len(failures) == 1
        assert failures[0].exc_info is not None
        assert made[0].closed
        assert model.complete(prompt="hi").text == "hello"  # loaded again, and it serves


def test_a_health_check_round_that_fails_is_logged_and_the_next_round_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with Runtime(keep_alive=None) as rt:
        # Nothing listens on port 9: every check finds the upstream down (that is handled).
        model = rt.add_remote("m", [Upstream("http://127.0.0.1:9", "m")], health_interval=0.02)
        engine = model.engines[0]
        assert isinstance(engine, RemoteEngine)
        rounds = threading.Semaphore(0)
        real_check = engine.check
        failed: list[bool] = []

        async def check(state: Any) -> bool:
            rounds.release()
            if not failed:
                failed.append(True)
                raise RuntimeError("the health check failed")
            return await real_check(state)

        with caplog.at_level(logging.ERROR, logger="tokenbelt.engines.remote"):
            engine.check = check  # type: ignore[method-assign]
            for _ in range(3):  # the failing round and two after it
                assert rounds.acquire(timeout=NET)
        assert engine.health_failures == 1
        failures = [r for r in caplog.records if "health check of" in r.getMessage()]
        assert len(failures) == 1
        assert failures[0].exc_info is not None
