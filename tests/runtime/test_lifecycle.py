"""The runtime's life: context managers, close, unload, keep-alive, observers, bad sizes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tokenbelt import (
    EndReason,
    IllegalState,
    InvalidArgument,
    ModelState,
    Runtime,
    RuntimeClosed,
    ScriptedEngine,
    UnknownModel,
)

from . import NET, Recorder, wait_until, words

#: every event of a request that ran and ended on its own
NATURAL = ["enqueued", "admitted", "first_token", "ended", "released"]
#: every event of a request that was stopped while it produced
STOPPED = ["enqueued", "admitted", "first_token", "cancel_requested", "ended", "released"]


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = Runtime(keep_alive=None)
    try:
        yield rt
    finally:
        rt.close()


# -- context managers and close ----------------------------------------------------------------


def test_with_runtime_closes_it() -> None:
    with Runtime() as rt:
        model = rt.add_engines("scripted", [ScriptedEngine(words(1000), delay=0.001)])
        stream = model.stream(prompt="hi", capacity=2)
        pieces = iter(stream)  # kept: a dropped iterator would cancel (user_cancel)
        assert next(pieces) == " w0"
    assert stream.end_reason is EndReason.SHUTDOWN
    assert stream.trace.released is not None
    assert model.state is ModelState.CLOSED
    assert rt.models == {}


@pytest.mark.anyio
async def test_async_with_runtime_closes_it() -> None:
    async with Runtime() as rt:
        model = rt.add_engines("scripted", [ScriptedEngine(words(1000), delay=0.001)])
        async with model.achat() as chat:
            reply = await chat.asend("hello", max_tokens=3)
            assert reply.text == " w0 w1 w2"
        stream = model.stream(prompt="again", capacity=2)
        pieces = aiter(stream)
        assert await anext(pieces) == " w0"
    # Leaving the runtime shut the running request down and waited for its release.
    assert stream.end_reason is EndReason.SHUTDOWN
    assert stream.trace.released is not None
    assert [p async for p in stream] == []
    assert model.state is ModelState.CLOSED


def test_close_is_idempotent_and_final(runtime: Runtime) -> None:
    model = runtime.add_engines("scripted", [ScriptedEngine(["x"])])
    runtime.close()
    runtime.close()
    assert model.state is ModelState.CLOSED
    with pytest.raises(RuntimeClosed):
        runtime.add_engines("again", [ScriptedEngine(["x"])])
    with pytest.raises(RuntimeClosed):
        model.stream(prompt="hi")


def test_unload_closes_one_model(runtime: Runtime) -> None:
    engine = ScriptedEngine(words(1000), delay=0.001)
    model = runtime.add_engines("scripted", [engine])
    other = runtime.add_engines("other", [ScriptedEngine(["y"])])
    stream = model.stream(prompt="hi", capacity=2)
    pieces = iter(stream)
    assert next(pieces) == " w0"

    runtime.unload("scripted")

    assert stream.end_reason is EndReason.SHUTDOWN
    assert stream.trace.released is not None
    assert model.state is ModelState.CLOSED
    assert engine.closed
    assert set(runtime.models) == {"other"}
    with pytest.raises(UnknownModel, match="scripted"):
        runtime.get("scripted")
    assert other.complete(prompt="hi").text == "y"


def test_get_names_the_loaded_models(runtime: Runtime) -> None:
    model = runtime.add_engines("scripted", [ScriptedEngine(["x"])])
    assert runtime.get("scripted") is model
    assert runtime.add_engines("scripted", [ScriptedEngine(["other"])]) is model
    with pytest.raises(UnknownModel, match="did you mean scripted"):
        runtime.get("scriptd")


@pytest.mark.parametrize(
    "kwargs",
    [{"slots": 0}, {"queue_size": 0}, {"capacity": 0}, {"capacity": 1.5}, {"kv_type": "q4_0"}],
)
def test_bad_sizes_are_rejected_up_front(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        Runtime(**kwargs)  # type: ignore[arg-type]


def test_bad_request_capacity_is_rejected(runtime: Runtime) -> None:
    model = runtime.add_engines("scripted", [ScriptedEngine(["x"])])
    with pytest.raises(InvalidArgument, match="capacity"):
        model.stream(prompt="hi", capacity=0)
    assert model.statistics().running == 0


# -- keep-alive --------------------------------------------------------------------------------


def test_an_idle_model_is_unloaded_and_the_next_request_reloads_it() -> None:
    made: list[ScriptedEngine] = []

    def factory() -> list[ScriptedEngine]:
        made.append(ScriptedEngine(["hello"], delay=0))
        return made[-1:]

    rt = Runtime(keep_alive=0.05)
    try:
        model = rt.add_engines("scripted", factory)
        assert model.complete(prompt="hi").text == "hello"
        wait_until(lambda: model.state is ModelState.IDLE_UNLOADED, "the idle unload")
        assert made[0].closed
        assert model.engines == []

        reply = model.complete(prompt="hi again")
        assert reply.text == "hello"
        assert reply.end_reason is EndReason.STOP
        assert len(made) == 2
    finally:
        rt.close()
    assert all(e.closed for e in made)


def keep_alive_timers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tokenbelt-keepalive-")]


def test_ready_made_engines_survive_the_keep_alive() -> None:
    engine = ScriptedEngine(["hello"], delay=0)
    keep_alive = 0.05
    rt = Runtime(keep_alive=keep_alive)
    try:
        model = rt.add_engines("scripted", [engine])
        assert model.complete(prompt="hi").text == "hello"
        # Past the keep-alive, with any timer it armed done: an unload would have happened.
        idle_since = time.monotonic()
        wait_until(
            lambda: time.monotonic() - idle_since > 4 * keep_alive and not keep_alive_timers(),
            "the keep-alive to pass",
        )
        # Engines handed over ready-made cannot be made again once closed: unloading
        # them for idling would leave the model nothing to reload.
        assert not engine.closed
        reply = model.complete(prompt="hi again")
        assert reply.text == "hello"
        assert reply.end_reason is EndReason.STOP
    finally:
        rt.close()
    assert engine.closed


def test_set_keep_alive_zero_unloads_an_idle_model_now_and_a_busy_one_at_its_release() -> None:
    made: list[ScriptedEngine] = []

    def factory() -> list[ScriptedEngine]:
        made.append(ScriptedEngine(words(1000), delay=0.001))
        return made[-1:]

    rt = Runtime(keep_alive=None)
    try:
        model = rt.add_engines("scripted", factory)
        assert model.reloadable
        context = model.context_length
        model.set_keep_alive(0)
        assert model.state is ModelState.IDLE_UNLOADED  # before set_keep_alive returned
        assert made[0].closed
        assert model.context_length == context  # what a reload will have again

        stream = model.stream(prompt="hi", capacity=2)  # loads again
        pieces = iter(stream)
        assert next(pieces) == " w0"
        assert len(made) == 2
        model.set_keep_alive(0)
        assert model.state is ModelState.READY  # busy: it stays until the release
        stream.cancel()
        wait_until(lambda: model.state is ModelState.IDLE_UNLOADED, "the unload at release")
        assert made[1].closed

        model.set_keep_alive(None)
        assert model.complete(prompt="again", max_tokens=2).text == " w0 w1"
        assert not keep_alive_timers()
        assert model.state is ModelState.READY
    finally:
        rt.close()


def test_set_keep_alive_refuses_ready_made_engines(runtime: Runtime) -> None:
    engine = ScriptedEngine(["hello"], delay=0)
    model = runtime.add_engines("scripted", [engine])
    assert not model.reloadable
    with pytest.raises(IllegalState):
        model.set_keep_alive(0)
    with pytest.raises(InvalidArgument):
        model.set_keep_alive(-1)
    model.set_keep_alive(None)  # "for ever" is what it has already
    assert model.state is ModelState.READY
    assert not engine.closed


# -- observers ---------------------------------------------------------------------------------


def test_runtime_observers_see_every_event_in_order() -> None:
    recorder = Recorder()
    rt = Runtime(keep_alive=None, observers=[recorder])
    try:
        model = rt.add_engines("scripted", [ScriptedEngine(words(100), delay=0)])
        done = model.stream(prompt="hi", max_tokens=3)
        assert "".join(done) == " w0 w1 w2"
        assert done.wait_released(NET)
        stopped = model.stream(prompt="hi")
        for _ in stopped:
            break
        assert stopped.wait_released(NET)
    finally:
        rt.close()
    assert recorder.kinds(done.request_id) == NATURAL
    assert recorder.kinds(stopped.request_id) == STOPPED
    times = [s.at for s in recorder.of(done.request_id)]
    assert times == sorted(times)


def test_an_observer_subscribed_later_sees_requests_of_loaded_models(runtime: Runtime) -> None:
    model = runtime.add_engines("scripted", [ScriptedEngine(["x"], delay=0)])
    recorder = Recorder()
    runtime.subscribe(recorder)
    stream = model.stream(prompt="hi")
    assert "".join(stream) == "x"
    assert stream.wait_released(NET)
    assert recorder.kinds(stream.request_id) == NATURAL


def test_requests_racing_an_immediate_idle_unload_reload_instead_of_failing() -> None:
    """With ``keep_alive=0`` the model unloads the moment it is idle, on a timer thread,
    while the next request may be between its load check and the queue: that request
    holds the unload off, or loads the model again; it is never told "closed"."""
    from tokenbelt import Runtime, ScriptedEngine

    with Runtime(keep_alive=0.0) as rt:
        model = rt.add_engines("flicker", lambda: [ScriptedEngine([" a", " b"], delay=0)])
        replies = [model.complete(prompt="go") for _ in range(100)]
    assert all(r.text == " a b" for r in replies)
