"""The SDK's code completion: ``Model.complete_middle`` and its kin on the real engine,
and supersede keys (a newer request with the key ends the older one, queued or running)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tokenbelt import EndReason, InvalidArgument, Runtime, ScriptedEngine
from tokenbelt.engines import Infill
from tokenbelt.models import default_model_path
from tokenbelt.runtime import Model

#: long enough that a completion is still running when the next one comes
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def runtime(fim_gguf: Path) -> Iterator[Runtime]:
    # One slot: a second request waits in the queue, so a supersede of a queued one shows.
    rt = Runtime(keep_alive=None, slots=1)
    rt.load(str(fim_gguf))
    rt.load(str(default_model_path()))
    yield rt
    rt.close()


@pytest.fixture
def fim(runtime: Runtime, fim_gguf: Path) -> Model:
    return runtime.models[fim_gguf.stem]


@pytest.fixture
def plain(runtime: Runtime) -> Model:
    return runtime.models[Path(default_model_path()).stem]


def test_complete_middle_between_a_prefix_and_a_suffix(fim: Model) -> None:
    assert fim.fills_middle is True
    assert fim.fim_tokens == {"pre": 8, "suf": 9, "mid": 10, "rep": 3, "sep": 5}
    reply = fim.complete_middle(
        "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n", max_tokens=8, temperature=0.0
    )
    assert reply.end_reason in (EndReason.STOP, EndReason.LENGTH)
    assert reply.usage.completion_tokens >= 1
    # The prompt is the FIM layout: the repository header, the parts, the middle token.
    prompt = fim.infill_prompt(Infill("def add(a, b):\n    ", "x"), 8)
    assert prompt.tokens[0] == 3
    assert prompt.tokens[-1] == 10


def test_streamed_and_async(fim: Model) -> None:
    stream = fim.stream_middle("x = 1\ny = ", "\nz = 3\n", max_tokens=4, temperature=0.0)
    pieces = list(stream)
    assert stream.end_reason is not None
    assert "".join(pieces) == stream.text

    async def both() -> str:
        reply = await fim.acomplete_middle("x = 1\ny = ", "\nz = 3\n", max_tokens=4)
        return reply.text

    assert isinstance(anyio.run(both), str)


def test_a_newer_request_with_the_key_ends_the_running_and_the_queued(fim: Model) -> None:
    before = fim.status().completions
    running = fim.stream_middle("a = ", "", supersede="buffer-1", **LONG)
    reading = iter(running)  # kept: a dropped reader would stop it (user_cancel)
    next(reading)  # it runs: its first token came
    queued = fim.stream_middle("b = ", "", supersede="buffer-3", **LONG)  # another key waits
    stale = fim.stream_middle("c = ", "", supersede="buffer-2", **LONG)  # queued too
    assert fim.statistics().queued == 2
    latest = fim.stream_middle("d = ", "", supersede="buffer-2", max_tokens=2)
    # The queued one with the key ended at once: it never ran.
    assert stale.wait_released(30)
    assert stale.end_reason is EndReason.SUPERSEDED
    assert stale.trace.admitted is None
    # The other key's requests are not touched by it.
    assert queued.end_reason is None
    newest = fim.stream_middle("e = ", "", supersede="buffer-1", max_tokens=2)
    assert running.wait_released(30)
    assert running.end_reason is EndReason.SUPERSEDED
    assert running.trace.completion_tokens < LONG["max_tokens"]
    queued.cancel()
    for s in (latest, newest):
        s.read()
        assert s.end_reason in (EndReason.STOP, EndReason.LENGTH)
    assert fim.superseding.superseded == 2
    # The model's completion statistics count them (at each release).
    ended = (running, queued, stale, latest, newest)
    assert all(s.wait_released(30) and s.trace.infill for s in ended)
    now = fim.status().completions
    assert now.completions - before.completions == 5
    assert now.superseded - before.superseded == 2
    after_stop = running.trace.tokens_after_stop + stale.trace.tokens_after_stop
    assert now.stale_tokens - before.stale_tokens == after_stop
    assert stale.trace.tokens_after_stop == 0  # it never ran
    assert now.first_token_p50 is not None


def test_a_model_without_fim_tokens_says_what_it_lacks(plain: Model) -> None:
    assert plain.fills_middle is False
    with pytest.raises(InvalidArgument) as caught:
        plain.complete_middle("a", "b")
    assert f"{plain.name} cannot fill in the middle" in str(caught.value)
    assert "no FIM prefix, suffix, middle tokens" in str(caught.value)
    assert caught.value.param == "suffix"


def test_an_engine_without_a_vocabulary_here_cannot_fill() -> None:
    rt = Runtime(keep_alive=None)
    try:
        model = rt.add_engines("scripted", [ScriptedEngine(["x"])])
        assert model.fills_middle is False
        with pytest.raises(InvalidArgument, match="ScriptedEngine"):
            model.complete_middle("a", "b")
    finally:
        rt.close()


def test_a_supersede_key_is_a_non_empty_string(fim: Model) -> None:
    with pytest.raises(InvalidArgument) as caught:
        fim.stream_middle("a", "b", supersede="")
    assert caught.value.param == "supersede"


def test_a_request_of_a_claim_already_superseded_ends_before_it_starts(fim: Model) -> None:
    # Its belt has ended before the engine takes it: the engine lets go inside its own
    # start, under the scheduler's lock, and the slot is handed on once that is let go.
    claim = fim.claim("buffer-9")
    fim.claim("buffer-9")
    stale = fim.stream_middle("a = ", "", supersede=claim, max_tokens=4)
    assert stale.wait_released(30)
    assert stale.end_reason is EndReason.SUPERSEDED
    assert stale.trace.first_token is None
    stats = fim.statistics()
    assert (stats.running, stats.queued) == (0, 0)
    assert fim.complete_middle("b = ", "", max_tokens=2).end_reason is not None
