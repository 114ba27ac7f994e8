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
