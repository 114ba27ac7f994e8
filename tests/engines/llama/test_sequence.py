"""What a sampled token becomes, without a model: ``Sequence.accept`` turns raw bytes
into text (UTF-8 across tokens), ends a request at a stop string, ``max_tokens`` or an
end token, and runs a thinking model's reasoning phase (a budget, the model's own end
marker, ``think=False``); ``ThinkingDeadline`` fires at its time.

Each sequence is a real ``Sequence`` on a real belt, its reasoning format built by hand.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tokenbelt import GenerationRequest, SamplingParams
from tokenbelt.belt import Belt, EndReason
from tokenbelt.engines.llama._reasoning import ANSWER, REASONING, ReasoningFormat
from tokenbelt.engines.llama._sequence import Accepted, Sequence, ThinkingDeadline

CONTEXT = 4096
PROMPT = [1, 2, 3]
FMT = ReasoningFormat(
    "<think>", "</think>", (7, 8), toggle=False, efforts=False, end_text="</think>\n\n"
)
MARKERS = {7: "</think>", 8: "\n\n"}


def make_seq(context: int = CONTEXT, prompt: list[int] = PROMPT, **sampling: Any) -> Sequence:
    belt: Belt[str] = Belt(8)
    request = GenerationRequest(prompt="p", sampling=SamplingParams(**sampling))
    seq = Sequence(request, belt.producer, lambda: None)
    seq.set_prompt(list(prompt), context)
    seq.id = 0
    seq.n_past = len(prompt)
    return seq


def thinking(
    prompt_tail: str = "<|assistant|>\n<think>\n", context: int = CONTEXT, **sampling: Any
) -> tuple[Sequence, list[Sequence]]:
    """A thinking model's chat sequence, and the calls of its ``on_thinking``."""
    seq = make_seq(context, **sampling)
    started: list[Sequence] = []
    seq.open_phases(FMT, prompt_tail, MARKERS, context, started.append)
    return seq, started


def feed(seq: Sequence, *pieces: bytes, first: int = 100) -> list[Accepted]:
    """Accept one token per piece (ids from ``first`` on)."""
    return [seq.accept(first + i, raw, end=False) for i, raw in enumerate(pieces)]


# -- text ---------------------------------------------------------------------------------------


def test_a_character_split_over_tokens_comes_out_whole() -> None:
    seq = make_seq()
    assert not seq.decoding
    got = feed(seq, b"caf\xc3", b"\xa9 ", b"\xf0\x9f", b"\x99", b"\x82!")
    assert [a.text for a in got] == ["caf", "é ", "", "", "🙂!"]
    assert all(a.end is None and a.scored and a.reasoning == "" for a in got)
    assert seq.tokens == [*PROMPT, 100, 101, 102, 103, 104]
    assert seq.decoding
    assert seq.produced == 5
    assert seq.producer.trace.completion_tokens == 5


def test_bytes_that_are_no_utf8_become_a_replacement_character() -> None:
    seq = make_seq()
    assert feed(seq, b"a\xffb")[0].text == "a\ufffdb"


def test_a_stop_string_ends_with_stop_and_the_trace_names_it() -> None:
    seq = make_seq(stop=("STOP",))
    got = feed(seq, b"Hello wor", b"ld. ST", b"OP here")
    assert got == [
        Accepted("Hello wor", "", None),
        Accepted("ld. ", "", None),  # "ST" is held back: it may start the stop string
        Accepted("", "", EndReason.STOP),
    ]
    assert seq.producer.trace.stop_sequence == "STOP"
    assert seq.tokens == [*PROMPT, 100, 101]  # the ending token is not appended


def test_a_held_back_start_that_is_no_stop_string_comes_out() -> None:
    seq = make_seq(stop=("STOP",))
    got = feed(seq, b"ST", b"AR")
    assert [a.text for a in got] == ["", "STAR"]
    assert seq.producer.trace.stop_sequence is None


def test_the_earliest_stop_string_in_the_text_wins() -> None:
    seq = make_seq(stop=("world", "lo w"))
    assert feed(seq, b"hello world") == [Accepted("hel", "", EndReason.STOP)]
    assert seq.producer.trace.stop_sequence == "lo w"


def test_max_tokens_ends_with_length_and_the_held_back_tail() -> None:
    seq = make_seq(max_tokens=3, stop=("zz",))
    got = feed(seq, b"a", b"b", b"cz")
    assert got[:2] == [Accepted("a", "", None), Accepted("b", "", None)]
    assert got[2] == Accepted("cz", "", EndReason.LENGTH)  # "z" was held for "zz"
    assert seq.tokens == [*PROMPT, 100, 101]
    assert seq.producer.trace.stop_sequence is None


def test_max_tokens_inside_a_character_drops_its_bytes() -> None:
    seq = make_seq(max_tokens=2)
    got = feed(seq, b"a", b"\xc3")
    assert got[1] == Accepted("", "", EndReason.LENGTH)  # no U+FFFD for a cut character


def test_the_context_bounds_the_reply() -> None:
    seq = make_seq(context=5, max_tokens=100)  # 3 prompt tokens of 5
    assert seq.max_new == 2
    assert [a.end for a in feed(seq, b"a", b"b")] == [None, EndReason.LENGTH]


def test_the_end_token_gives_stop_with_the_held_back_tail_unscored() -> None:
    seq = make_seq(stop=("STOP",))
    assert feed(seq, b"Go ST") == [Accepted("Go ", "", None)]
    end = seq.accept(2, b"</s>", end=True)
    assert end == Accepted("ST", "", EndReason.STOP, scored=False)
    assert seq.produced == 1  # the end token is no produced token
    assert seq.producer.trace.completion_tokens == 1
    assert seq.tokens == [*PROMPT, 100]
    assert seq.producer.trace.stop_sequence is None


# -- a thinking model's reasoning phase ---------------------------------------------------------


def test_reasoning_opened_in_the_prompt_goes_to_the_reasoning_part() -> None:
    seq, started = thinking()
    assert seq.phases is not None
    assert seq.phases.state == REASONING
    got = feed(seq, b"Let me", b" see.")
    assert got == [Accepted("", "Let me", None), Accepted("", " see.", None)]
    assert started == [seq]  # the clock starts once, at the first reasoning token
    trace = seq.producer.trace
    assert trace.reasoning_started is not None
    assert trace.reasoning_tokens == 0  # counted when the phase ends
    assert trace.reasoning_ended_by is None


def test_a_reasoning_budget_reached_ends_the_phase_and_appends_the_end_tokens() -> None:
    seq, _ = thinking(reasoning_budget=2)
    got = feed(seq, b"Let me", b" think </th")
    assert got == [Accepted("", "Let me", None), Accepted("", " think ", None)]
    assert seq.tokens == [*PROMPT, 100, 101, 7, 8]  # decoded with the next step
    assert seq.phases is not None
    assert seq.phases.state == ANSWER
    trace = seq.producer.trace
    assert trace.reasoning_ended_by == "budget"
    assert trace.reasoning_tokens == 2
    assert trace.answer_started is None
    # The next sampled token is the answer's; the text held back is not lost.
    assert seq.accept(102, b"Four", end=False) == Accepted("Four", "</th", None)
    assert trace.answer_started is not None


def test_the_models_own_end_marker_ends_the_phase() -> None:
    seq, _ = thinking(reasoning_budget=10)
    seq.think_until = time.monotonic() + 60.0
    got = [
        seq.accept(100, b"Hmm", end=False),
        seq.accept(7, b"", end=False),  # its text is the marker's (``markers``)
        seq.accept(8, b"", end=False),
        seq.accept(101, b"Yes", end=False),
    ]
    assert got == [
        Accepted("", "Hmm", None),
        Accepted("", "", None),
        Accepted("", "", None),
        Accepted("Yes", "", None),
    ]
    assert seq.think_until is None
    assert seq.tokens == [*PROMPT, 100, 7, 8, 101]  # nothing forced
    trace = seq.producer.trace
    assert trace.reasoning_ended_by == "marker"
    assert trace.reasoning_tokens == 2  # the marker is a reasoning token too


def test_a_model_that_opens_its_reasoning_itself_starts_the_clock() -> None:
    seq, started = thinking(prompt_tail="<|assistant|>\n")
    assert feed(seq, b"<think>", b"Hmm") == [Accepted("", "", None), Accepted("", "Hmm", None)]
    assert started == [seq]
    assert seq.producer.trace.reasoning_started is not None


def test_a_reply_that_never_opens_reasoning_is_all_answer() -> None:
    seq, started = thinking(prompt_tail="<|assistant|>\n", reasoning_budget=0)
    assert feed(seq, b"Hi", b" there") == [Accepted("Hi", "", None), Accepted(" there", "", None)]
    assert started == []
    assert seq.tokens == [*PROMPT, 100, 101]
    assert seq.producer.trace.reasoning_started is None


def test_think_false_without_a_switch_closes_the_phase_in_the_prompt() -> None:
    seq, _ = thinking(think=False)
    assert seq.think_budget == 0
    assert seq.tokens == [*PROMPT, 7, 8]  # the marker joins the prompt
    assert seq.phases is not None
    assert seq.phases.state == ANSWER
    assert seq.producer.trace.reasoning_ended_by == "budget"
    assert feed(seq, b"Four") == [Accepted("Four", "", None)]


def test_think_false_with_a_switch_is_the_templates_to_apply() -> None:
    seq = make_seq(think=False)
    fmt = ReasoningFormat("<think>", "</think>", (7, 8), toggle=True, efforts=False)
    seq.open_phases(fmt, "<|assistant|>\n", MARKERS, CONTEXT, lambda s: None)
    assert seq.think_budget is None
    assert seq.tokens == PROMPT


def test_stop_strings_never_see_the_reasoning() -> None:
    seq, _ = thinking(stop=("wait",), reasoning_budget=1)
    assert feed(seq, b"wait") == [Accepted("", "wait", None)]  # reasoning: no stop
    assert seq.accept(101, b"Now wait", end=False) == Accepted("Now ", "", EndReason.STOP)
    assert seq.producer.trace.stop_sequence == "wait"


def test_open_phases_keeps_room_for_the_end_marker() -> None:
    seq, _ = thinking(context=10)  # 3 prompt tokens: 7 left, 2 of them for the marker
    assert seq.max_new == 5


def test_length_inside_the_reasoning_gives_its_held_back_text() -> None:
    seq, _ = thinking(max_tokens=2)
    got = feed(seq, b"Hmm", b" ok </thi")
    assert got[1] == Accepted("", " ok </thi", EndReason.LENGTH)


def test_end_reasoning_appends_the_marker_once() -> None:
    seq, _ = thinking()
    feed(seq, b"Hmm")
    seq.think_until = time.monotonic() + 60.0
    seq.end_reasoning("deadline")
    seq.end_reasoning("deadline")
    assert seq.tokens == [*PROMPT, 100, 7, 8]
    assert seq.think_until is None
    assert seq.producer.trace.reasoning_ended_by == "deadline"
    assert seq.producer.trace.reasoning_tokens == 1


def test_close_phases_counts_a_reasoning_that_never_ended_once() -> None:
    seq, _ = thinking()
    feed(seq, b"a", b"b", b"c")
    seq.close_phases()
    trace = seq.producer.trace
    assert trace.reasoning_tokens == 3
    assert trace.reasoning_ended_by is None  # it did not end: the request did
    assert seq.phases is not None
    assert seq.phases.state == ANSWER
    seq.phases.tokens = 99
    seq.close_phases()
    assert trace.reasoning_tokens == 3


# -- ThinkingDeadline ---------------------------------------------------------------------------


def test_a_thinking_deadline_fires_at_its_time_and_not_after_the_phase_ended() -> None:
    seq, _ = thinking()
    expired: list[Sequence] = []
    deadline = ThinkingDeadline(seq, expired.append)
    assert deadline.expire() is None  # no deadline set: nothing to do
    later = time.monotonic() + 60.0
    seq.think_until = later
    assert deadline.expire() == later  # not yet: when to look again
    assert expired == []
    seq.think_until = time.monotonic() - 0.001
    assert deadline.expire() is None
    assert expired == [seq]


@pytest.mark.parametrize("by", ["budget", "deadline"])
def test_end_reasoning_ends_the_deadline(by: str) -> None:
    seq, _ = thinking()
    feed(seq, b"Hmm")
    seq.think_until = time.monotonic() - 1.0
    expired: list[Sequence] = []
    seq.end_reasoning(by)
    assert ThinkingDeadline(seq, expired.append).expire() is None
    assert expired == []
