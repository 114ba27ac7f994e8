"""Prompt-lookup drafting: the same text, counted in the trace, stoppable, self-limiting.

One runtime (drafting on by default: it decides for itself) serves the module, prefix
cache off so every prompt is computed the same way. The repetitive prompt makes the
model copy a pattern, which a lookup drafts well; the story does not repeat.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tokenbelt import EndReason, InvalidArgument, Model, Runtime
from tokenbelt.engines import BatchStatistics, GenerationRequest
from tokenbelt.models import default_model_path

from . import NET, wait_until

pytestmark = pytest.mark.model

GREEDY: dict[str, Any] = {"temperature": 0.0}
COUNTING = ", ".join(str(n) for n in range(1, 11))
REPEAT = [
    {
        "role": "user",
        "content": "Repeat this line four times, nothing else:\n" + COUNTING,
    }
]
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    rt = Runtime(slots=2, keep_alive=None, n_ctx=1024, prefix_cache=False, capacity=32)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture(scope="module")
def model(runtime: Runtime) -> Model:
    return runtime.load(str(default_model_path()))


def test_greedy_text_is_the_same_with_and_without_drafting(model: Model) -> None:
    plain = model.complete(REPEAT, max_tokens=64, draft="off", **GREEDY)
    drafted = model.complete(REPEAT, max_tokens=64, draft="lookup", **GREEDY)
    assert drafted.text == plain.text
    assert plain.trace.draft_tokens == plain.trace.accepted_draft_tokens == 0
    assert drafted.trace.draft_tokens > 0
    assert 0 < drafted.trace.accepted_draft_tokens <= drafted.trace.draft_tokens
    assert drafted.trace.to_dict()["accepted_draft_tokens"] > 0


def test_a_seeded_sampled_reply_is_valid_and_counted(model: Model) -> None:
    reply = model.complete(REPEAT, max_tokens=64, draft="lookup", temperature=0.7, seed=11)
    t = reply.trace
    assert reply.text.strip()
    assert t.end_reason in (EndReason.STOP, EndReason.LENGTH)
    assert t.completion_tokens <= 64
    assert t.accepted_draft_tokens <= t.draft_tokens
    assert t.accepted_draft_tokens < t.completion_tokens  # each step samples one of its own


def drafted(model: Model) -> int:
    stats = model.engines[0].statistics()
    assert isinstance(stats, BatchStatistics)
    return stats.draft_tokens


def test_a_cancel_with_a_draft_in_flight_ends_user_cancel_and_frees_it(model: Model) -> None:
    before = drafted(model)
    stream = model.stream(REPEAT, max_tokens=400, draft="lookup", ignore_eos=True, **GREEDY)
    pieces = iter(stream)
    # Read until the engine verifies drafts for it: its steps carry one from now on.
    while drafted(model) == before:
        next(pieces)
    stream.cancel()
    assert stream.wait_released(NET)
    assert stream.end_reason is EndReason.USER_CANCEL
    assert stream.trace.draft_tokens > 0
    wait_until(lambda: model.statistics().running == 0, "the slot to be free")
    after = model.complete(REPEAT, max_tokens=8, draft="lookup", **GREEDY)
    assert after.text


def test_drafting_turns_itself_off_on_free_text(model: Model) -> None:
    reply = model.complete(STORY, max_tokens=160, temperature=0.8, seed=3)
    t = reply.trace
    # Off until a shadow draft shows it pays: a few verified drafts at most, not one a step.
    assert t.draft_tokens <= t.completion_tokens // 4, t.to_dict()
    assert t.draft_decision in ("on", "no_gain", "nothing_to_copy")
    if t.draft_tokens == 0:
        assert t.draft_decision != "on"


def test_with_no_setting_a_copying_reply_drafts_and_says_why(model: Model) -> None:
    before = model.engines[0].statistics()
    assert isinstance(before, BatchStatistics)
    # Long enough (the end token ignored) that a sequence whose shadow drafts are all
    # accepted verifies one even while a loaded machine's step costs say no (``probe``).
    reply = model.complete(REPEAT, max_tokens=96, ignore_eos=True, **GREEDY)
    assert reply.trace.draft_tokens > 0
    assert reply.trace.draft_decision == "on"
    asked_off = model.complete(REPEAT, max_tokens=8, draft="off", **GREEDY)
    assert asked_off.trace.draft_decision == "asked_off"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = model.complete(REPEAT, max_tokens=16, schema=schema, **GREEDY)
    assert constrained.trace.draft_decision == "constrained"
    assert constrained.trace.draft_tokens == 0
    after = model.engines[0].statistics()
    assert isinstance(after, BatchStatistics)
    grew = {k: after.draft_decisions[k] - before.draft_decisions.get(k, 0) for k in ("on",)}
    assert grew["on"] >= 1
    assert after.draft_decisions["asked_off"] >= 1
    assert after.draft_decisions["constrained"] >= 1
    # The row costs drafting weighed, measured on this machine by the steps it ran.
    costs = after.row_costs()
    assert costs, after.step_costs
    assert all(c > 0 for c in costs.values()), costs


def test_a_bad_draft_mode_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="draft must be one of lookup, off"):
        GenerationRequest(prompt="hi", draft="ngram")
    with pytest.raises(InvalidArgument, match="draft must be one of lookup, off"):
        Runtime(draft="always")
