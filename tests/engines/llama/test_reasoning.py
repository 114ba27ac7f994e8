"""A thinking model's reasoning phase in the batch engine: markers found in the template,
the reply split into reasoning and answer, a token budget and a thinking deadline that
force the end marker, stop strings and grammars that wait for the answer.

The thinking model is the default model with a Qwen3-style template whose generation
prompt opens ``<think>`` (``THINKING_TEMPLATE``); its vocabulary has no ``<think>``
token, so the forced end marker is the tokenized ``</think>`` text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenbelt import EndReason, GenerationRequest, InvalidArgument, SamplingParams
from tokenbelt.belt import Belt
from tokenbelt.engines import BatchEngine, Message, Piece
from tokenbelt.engines.llama._reasoning import (
    ANSWER,
    PENDING,
    REASONING,
    PhaseSplitter,
    ReasoningFormat,
    separator_after,
)
from tokenbelt.models import default_model_path

pytestmark = pytest.mark.model

NET = 60.0
STORY: list[Message] = [
    {"role": "user", "content": "Write a long story about a dragon who learns to fly."}
]
SUM: list[Message] = [{"role": "user", "content": "What is 2+2?"}]
FMT = ReasoningFormat("<think>", "</think>", (1, 2), toggle=False, efforts=False)


def run(
    engine: BatchEngine, messages: list[Message], **sampling: object
) -> tuple[Belt[str], str, str]:
    """One request to its end: the belt, and its (reasoning, answer) text."""
    params = {"temperature": 0.0, "max_tokens": 48} | sampling
    request = GenerationRequest.chat(messages, SamplingParams(**params))  # type: ignore[arg-type]
    engine.count_prompt_tokens(request)
    belt: Belt[str] = Belt(256)
    belt.trace.mark_enqueued()
    engine.start(request, belt.producer)
    reasoning, answer = [], []
    for piece in belt:
        reasoning.append(piece.reasoning if isinstance(piece, Piece) else "")
        answer.append(str(piece))
    assert belt.wait_released(NET)
    return belt, "".join(reasoning), "".join(answer)


@pytest.fixture(scope="module")
def thinker(thinking_model: Path) -> Iterator[BatchEngine]:
    engine = BatchEngine(thinking_model, slots=2, n_ctx=1024)
    try:
        yield engine
    finally:
        engine.close()


# -- the splitter, on text -----------------------------------------------------------------


def split(splitter: PhaseSplitter, pieces: list[str]) -> tuple[str, str]:
    parts = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    return "".join(r for r, _ in parts), "".join(a for _, a in parts)


def test_a_marker_split_across_pieces_is_held_back_and_never_shown() -> None:
    splitter = PhaseSplitter(FMT, opened=True)
    assert split(splitter, ["\nI add", " them.</", "thi", "nk>\n\n", "Four", "."]) == (
        "I add them.",
        "Four.",
    )
    assert splitter.state == ANSWER


def test_a_model_that_opens_its_own_reasoning_is_seen_doing_so() -> None:
    splitter = PhaseSplitter(FMT, opened=False)
    assert splitter.feed("  <th") == ("", "")
    assert splitter.state == PENDING
    assert splitter.feed("ink>hmm") == ("hmm", "")
    assert splitter.state == REASONING
    assert split(splitter, ["</think>ok"]) == ("", "ok")


def test_a_reply_without_markers_is_all_answer_and_kept_as_written() -> None:
    splitter = PhaseSplitter(FMT, opened=False)
    assert split(splitter, ["Hello", " <b>", "there"]) == ("", "Hello <b>there")


def test_a_phase_ended_by_the_engine_keeps_the_text_it_held() -> None:
    splitter = PhaseSplitter(FMT, opened=True)
    assert splitter.feed("so </th") == ("so ", "")
    splitter.end_now()
    assert split(splitter, ["\nyes"]) == ("</th", "yes")


# -- the engine ------------------------------------------------------------------------------


def test_the_markers_come_from_the_template_and_the_vocabulary(thinker: BatchEngine) -> None:
    fmt = thinker.reasoning
    assert fmt is not None
    assert (fmt.start, fmt.end, fmt.toggle, fmt.efforts) == ("<think>", "</think>", True, False)
    # No ``</think>`` token in this vocabulary: the marker is its text, tokenized.
    assert len(fmt.end_tokens) > 1


def test_a_model_without_markers_is_unchanged_with_the_split_on_or_off() -> None:
    on = BatchEngine(default_model_path(), slots=1, n_ctx=1024)
    try:
        assert on.reasoning is None
        first = run(on, SUM)
    finally:
        on.close()
    off = BatchEngine(default_model_path(), slots=1, n_ctx=1024, reasoning=False)
    try:
        second = run(off, SUM)
    finally:
        off.close()
    assert first[1:] == second[1:] == ("", first[2])
    assert first[2]
    assert first[0].trace.to_dict()["reasoning"] is None


def test_a_reply_is_split_and_the_trace_records_the_phase(thinker: BatchEngine) -> None:
    belt, reasoning, answer = run(thinker, STORY, reasoning_budget=4)
    assert reasoning.strip()
    assert answer.strip()
    assert "<think>" not in reasoning + answer
    assert "</think>" not in reasoning + answer
    t = belt.trace
    assert (t.reasoning_tokens, t.reasoning_ended_by, t.phase) == (4, "budget", "answer")
    assert t.reasoning_started is not None
    assert t.reasoning_ended is not None
    assert t.reasoning_started <= t.reasoning_ended


def test_a_budget_of_16_ends_reasoning_at_16_and_an_answer_follows(thinker: BatchEngine) -> None:
    belt, reasoning, answer = run(thinker, STORY, reasoning_budget=16, max_tokens=40)
    assert belt.trace.reasoning_tokens == 16
    assert belt.trace.reasoning_ended_by == "budget"
    assert reasoning
    assert answer.strip()
    assert belt.end_reason is EndReason.LENGTH  # the answer went on to max_tokens


def test_think_false_closes_the_section_in_the_prompt(thinker: BatchEngine) -> None:
    belt, reasoning, answer = run(thinker, SUM, think=False)
    assert (reasoning, belt.trace.phase) == ("", None)
    assert answer.strip()


def test_a_thinking_deadline_starts_the_answer_within_one_step(thinker: BatchEngine) -> None:
    belt, reasoning, answer = run(thinker, STORY, reasoning_timeout=0.3, max_tokens=120)
    t = belt.trace
    assert t.reasoning_ended_by == "deadline"
    assert reasoning
    assert answer
    assert t.reasoning_started is not None
    assert t.reasoning_ended is not None
    deadline, step = t.reasoning_started + 0.3, max(t.token_gaps)
    # The end marker went in a plain step and its own step before the deadline (a step
    # of several tokens costs a few one-token steps), so the answer's first token came
    # out by the deadline: within a step of it, on a machine whose steps vary.
    assert deadline - 4 * step <= t.reasoning_ended <= deadline + step
    assert t.answer_started is not None
    assert t.reasoning_ended <= t.answer_started <= deadline + step
    assert t.to_dict()["reasoning"]["answer_started_ms"] is not None


def test_a_stop_string_inside_the_reasoning_does_not_end_the_request(
    thinker: BatchEngine,
) -> None:
    _, free, _ = run(thinker, STORY, reasoning_budget=12, max_tokens=30)
    word = free.split()[1]
    belt, reasoning, answer = run(thinker, STORY, reasoning_budget=12, max_tokens=30, stop=[word])
    assert word in reasoning
    assert belt.trace.reasoning_ended_by == "budget"
    assert answer  # the answer started although the stop string was in the reasoning


def test_a_limit_inside_the_reasoning_ends_in_that_phase(thinker: BatchEngine) -> None:
    belt, reasoning, answer = run(thinker, STORY, max_tokens=8)
    assert (belt.end_reason, answer, belt.trace.phase) == (EndReason.LENGTH, "", "reasoning")
    assert reasoning
    assert belt.trace.reasoning_tokens == 8
    assert belt.trace.to_dict()["reasoning"]["phase"] == "reasoning"


def test_think_is_refused_where_the_template_cannot_honour_it(thinker: BatchEngine) -> None:
    plain = BatchEngine(default_model_path(), slots=1, n_ctx=512)
    try:
        with pytest.raises(InvalidArgument, match="no thinking phase") as no_phase:
            plain.count_prompt_tokens(GenerationRequest.chat(SUM, SamplingParams(think=True)))
    finally:
        plain.close()
    assert no_phase.value.param == "think"
    with pytest.raises(InvalidArgument, match="effort level"):
        thinker.count_prompt_tokens(GenerationRequest.chat(SUM, SamplingParams(think="high")))
    with pytest.raises(InvalidArgument, match="think must be"):
        SamplingParams(think="max")
    with pytest.raises(InvalidArgument, match="reasoning_budget"):
        SamplingParams(reasoning_budget=-1)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '<think>\\n\\n</think>\\n\\n' }}", "\n\n"),  # escapes in a Jinja string
        ("<think>\n\n</think>\n\n{% endif %}", "\n\n"),  # literal newlines
        ("{% set c = m.split('</think>')[-1] %}...'</think>\\n\\n'", "\n\n"),  # Qwen3's split
        ("<think></think>{{ x }}", ""),
    ],
)
def test_the_forced_end_is_the_marker_and_the_white_space_the_template_writes_after_it(
    template: str, expected: str
) -> None:
    assert separator_after(template, "</think>") == expected


def test_a_forced_end_leaves_the_answers_first_word_as_the_next_token(
    thinker: BatchEngine,
) -> None:
    fmt = thinker.reasoning
    assert fmt is not None
    assert fmt.end_text == "</think>\n\n"
    # The tokens forced are the marker and the template's two newlines: decoded together,
    # they let the next sampled token start the answer itself.
    assert thinker._words.detokenize(list(fmt.end_tokens)) == "</think>\n\n"
