"""A thinking model through the SDK: ``Reply.reasoning`` beside its answer, in this
process and in a worker process (the phase's trace marks cross the pipe), and a limit
that ended a reply before its answer started said plainly (``answer_started``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenbelt import EndReason, Limits, Runtime
from tokenbelt.engines import Piece

pytestmark = pytest.mark.model

STORY: Any = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]


@pytest.fixture(params=["thread", "process"])
def runtime(request: pytest.FixtureRequest, thinking_model: Path) -> Iterator[Runtime]:
    rt = Runtime(keep_alive=None, isolation=request.param)
    try:
        rt.load(str(thinking_model))
        yield rt
    finally:
        rt.close()


def test_a_reply_holds_its_reasoning_and_its_answer(runtime: Runtime) -> None:
    model = next(iter(runtime.models.values()))
    assert model.thinks
    stream = model.stream(STORY, temperature=0.0, max_tokens=24, reasoning_budget=8)
    parts = [piece.part if isinstance(piece, Piece) else "answer" for piece in stream]
    reply = stream.reply()
    assert parts[0] == "reasoning"
    assert "reasoning" not in parts[parts.index("answer") :]
    assert reply.reasoning.strip()
    assert reply.text.strip()
    assert reply.answer_started
    assert reply.usage.reasoning_tokens == 8
    assert reply.usage.to_dict()["completion_tokens_details"] == {"reasoning_tokens": 8}
    assert stream.wait_released(30)
    t = reply.trace
    assert (t.reasoning_tokens, t.reasoning_ended_by, t.phase) == (8, "budget", "answer")
    assert t.reasoning_started is not None
    assert t.reasoning_ended is not None
    assert t.enqueued is not None
    assert t.enqueued <= t.reasoning_started <= t.reasoning_ended
    # The first answer token's time crosses the worker's pipe as the phase's marks do.
    assert t.answer_started is not None
    assert t.reasoning_ended <= t.answer_started


def test_a_total_deadline_inside_the_reasoning_says_the_answer_never_started(
    runtime: Runtime,
) -> None:
    model = next(iter(runtime.models.values()))
    reply = model.stream(STORY, temperature=0.0, max_tokens=2000, limits=Limits(total=1.0)).read()
    assert reply.end_reason is EndReason.TOTAL_TIMEOUT
    # The template opened the reasoning in the prompt: whatever came, came inside it.
    assert (reply.text, reply.answer_started, reply.trace.phase) == ("", False, "reasoning")
    assert reply.trace.reasoning_tokens == reply.trace.completion_tokens
