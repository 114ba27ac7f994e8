"""The keep-alive counts from the load, not only from the end of the last request."""

from __future__ import annotations

from tokenbelt import EndReason, GenerationRequest, ModelState, Runtime, ScriptedEngine

from . import wait_until


def test_a_model_loaded_and_never_used_is_unloaded_after_the_keep_alive() -> None:
    made: list[ScriptedEngine] = []

    def factory() -> list[ScriptedEngine]:
        made.append(ScriptedEngine(["hello"], delay=0))
        return made[-1:]

    rt = Runtime(keep_alive=0.05)
    try:
        model = rt.add_engines("scripted", factory)
        assert model.state is ModelState.READY
        # No request at all: the timer armed by the load unloads it.
        wait_until(lambda: model.state is ModelState.IDLE_UNLOADED, "the idle unload")
        assert made[0].closed
        reply = model.complete(prompt="hi")
        assert reply.text == "hello"
        assert reply.end_reason is EndReason.STOP
        assert len(made) == 2
    finally:
        rt.close()
    assert all(e.closed for e in made)


def test_counting_a_prompt_reloads_the_model_and_the_keep_alive_counts_again() -> None:
    made: list[ScriptedEngine] = []

    def factory() -> list[ScriptedEngine]:
        made.append(ScriptedEngine(["hello"], delay=0))
        return made[-1:]

    rt = Runtime(keep_alive=0.05)
    try:
        model = rt.add_engines("scripted", factory)
        wait_until(lambda: model.state is ModelState.IDLE_UNLOADED, "the idle unload")
        request = GenerationRequest(messages=({"role": "user", "content": "two words"},))
        assert model.count_prompt_tokens(request) == made[-1].count_prompt_tokens(request)
        assert len(made) == 2  # loaded again to count
        # Nothing was queued, so no request's end re-arms the timer: the count itself did.
        wait_until(lambda: model.state is ModelState.IDLE_UNLOADED, "the idle unload")
        assert model.statistics().queued == 0
    finally:
        rt.close()


def test_a_requests_own_keep_alive_holds_for_that_request_only() -> None:
    """As Ollama defines it: ``keep_alive=0`` unloads after that request; the next request
    that gives none brings back the model's own, which no request changed."""
    made: list[ScriptedEngine] = []

    def factory() -> list[ScriptedEngine]:
        made.append(ScriptedEngine(["hello"], delay=0))
        return made[-1:]

    rt = Runtime(keep_alive=300.0)
    try:
        model = rt.add_engines("scripted", factory)
        assert model.submit(GenerationRequest(prompt="hi"), keep_alive=0).read().text == "hello"
        wait_until(lambda: model.state is ModelState.IDLE_UNLOADED, "the unload after it")
        assert model.keep_alive == 300.0

        stream = model.submit(GenerationRequest(prompt="hi"))  # no keep-alive of its own
        stream.read()
        assert stream.wait_released(5.0)
        assert len(made) == 2  # loaded again for it
        assert model.idle_keep_alive == 300.0
        assert model.state is ModelState.READY

        model.submit(GenerationRequest(prompt="hi"), keep_alive=None).read()
        assert model.idle_keep_alive is None  # for ever, after that one
        assert model.keep_alive == 300.0
        model.complete(prompt="hi")
        assert model.idle_keep_alive == 300.0
    finally:
        rt.close()


def test_set_keep_alive_is_the_default_for_later_requests() -> None:
    rt = Runtime(keep_alive=300.0)
    try:
        model = rt.add_engines("scripted", lambda: [ScriptedEngine(["hello"], delay=0)])
        model.set_keep_alive(60.0)
        model.complete(prompt="hi")
        assert (model.keep_alive, model.idle_keep_alive) == (60.0, 60.0)
        model.keep_loaded_for(5.0)  # once, not the default
        assert (model.keep_alive, model.idle_keep_alive) == (60.0, 5.0)
        model.complete(prompt="hi")
        assert model.idle_keep_alive == 60.0
    finally:
        rt.close()


def test_a_timer_that_fires_after_its_keep_alive_was_changed_unloads_nothing() -> None:
    """The keep-alive changed to "for ever" while its old timer was firing: that timer's
    run finds it is no longer the model's and leaves the model loaded."""
    with Runtime(keep_alive=300.0) as rt:
        model = rt.add_engines("scripted", lambda: [ScriptedEngine(["x"], delay=0)])
        old = model._keep.timer
        assert old is not None
        model.set_keep_alive(None)  # cancels the old timer: too late if it already fired
        model._keep.expired(old)  # the old timer's thread, running anyway
        assert model.state is ModelState.READY
        assert model.unloaded_because is None
