"""One admitted request in the batch engine, and what a sampled token becomes.

``Sequence`` holds a request's tokens, its place in the KV cache (``id``, ``n_past``),
its draft and its text state: the UTF-8 decoder, the stop strings, a thinking model's
reasoning phase and ``max_tokens``. ``accept(token, raw, end=...)`` turns one sampled
token into what goes on the belt and says whether the request ends with it; it touches
no native state, so every rule of a reply's text is here, in Python.

Threads: the engine's loop owns a sequence; another thread only sets ``cancelled``
(under the engine's lock) and reads ``id`` through ``StepInFlight``.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...belt import EndReason, Producer
from .._request import GenerationRequest, Piece
from ._draft import Lookup
from ._grammar import GrammarSampler
from ._native import StopMatcher, held_back
from ._reasoning import ANSWER, REASONING, PhaseSplitter, ReasoningFormat


@dataclass(frozen=True, slots=True)
class Accepted:
    """What one sampled token became: ``text`` and ``reasoning`` for the belt, and the
    request's end when this token ends it (None: it goes on). ``scored`` is False for
    an end token, whose text (what the reply held back) is not the token's own."""

    text: str
    reasoning: str
    end: EndReason | None
    scored: bool = True


def parts(text: str, reasoning: str) -> str:
    """A thinking model's text as it goes on the belt: a ``Piece`` when it carries
    reasoning, else the plain string."""
    return Piece(text, (), reasoning) if reasoning else text


class Sequence:
    """One admitted request: its tokens, its place in the KV cache, its sampler, and
    its reply's text state (``accept``)."""

    __slots__ = (
        "cancelled",
        "decoder",
        "draft",
        "fmt",
        "grammar",
        "id",
        "lookup",
        "markers",
        "max_new",
        "n_past",
        "n_prompt",
        "on_exit",
        "on_thinking",
        "phases",
        "prepared",
        "produced",
        "producer",
        "request",
        "sampler",
        "stopper",
        "think_budget",
        "think_timer",
        "think_until",
        "tokens",
        "waiting_room",
    )

    def __init__(
        self, request: GenerationRequest, producer: Producer[str], on_exit: Callable[[], None]
    ) -> None:
        self.request = request
        self.producer = producer
        self.on_exit = on_exit
        self.id = -1
        self.tokens: list[int] = []  # prompt, then every sampled token
        self.n_past = 0  # tokens[:n_past] are in the KV cache
        self.n_prompt = 0
        self.produced = 0
        self.max_new = 0
        self.sampler: Any = None
        self.grammar: GrammarSampler | None = None
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stopper = StopMatcher(request.sampling.stop)
        self.cancelled = False
        self.waiting_room = False
        self.prepared = False  # started and tokenized (it may still wait to share a prefix)
        #: a thinking model's chat request: its markers, its output split into reasoning
        #: and answer, and marker tokens rendered as their text
        self.fmt: ReasoningFormat | None = None
        self.phases: PhaseSplitter | None = None
        self.markers: dict[int, str] = {}
        #: reasoning tokens allowed (None: no budget), and the phase's monotonic deadline
        self.think_budget: int | None = None
        self.think_until: float | None = None
        #: what the engine's deadline timer holds (weakly) for that deadline
        self.think_timer: ThinkingDeadline | None = None
        #: called when the reasoning phase starts (the engine starts its clock)
        self.on_thinking: Callable[[Sequence], None] | None = None
        #: prompt-lookup drafting (None: off for this request), and the draft in flight:
        #: its cells follow the pending token's in the KV cache until it is verified
        self.lookup: Lookup | None = None
        self.draft: list[int] = []

    @property
    def decoding(self) -> bool:
        return self.produced > 0 or len(self.tokens) > self.n_prompt

    def set_prompt(self, tokens: list[int], context_length: int) -> None:
        """The prompt's tokens; the reply may take what is left of ``context_length``."""
        self.tokens = tokens
        self.n_prompt = len(tokens)
        self.max_new = min(self.request.sampling.max_tokens, context_length - len(tokens))

    # -- the reasoning phase -----------------------------------------------------------------

    def open_phases(
        self,
        fmt: ReasoningFormat,
        prompt_tail: str,
        markers: dict[int, str],
        context_length: int,
        on_thinking: Callable[[Sequence], None],
    ) -> None:
        """Split a thinking model's chat reply; its reasoning may open in the prompt
        (``prompt_tail``: the prompt's last tokens as text)."""
        s = self.request.sampling
        opened = fmt.opens_in(prompt_tail)
        self.fmt, self.markers, self.on_thinking = fmt, markers, on_thinking
        self.phases = PhaseSplitter(fmt, opened)
        # A template without a switch is told "no thinking" by a budget of nothing.
        self.think_budget = 0 if s.think is False and not fmt.toggle else s.reasoning_budget
        # Room for a forced end marker within the sequence's cells.
        room = context_length - len(self.tokens) - len(fmt.end_tokens)
        self.max_new = max(1, min(self.max_new, room))
        if opened and self.think_budget == 0:
            self.end_reasoning("budget")  # the marker joins the prompt

    def end_reasoning(self, by: str) -> None:
        """End the reasoning phase now (``budget``, ``deadline``): the end marker is
        appended, to be decoded with the next step, and the answer starts after it."""
        phases, fmt = self.phases, self.fmt
        assert phases is not None
        assert fmt is not None
        self.think_until = None
        if phases.state != REASONING:
            return
        phases.end_now()
        self.tokens.extend(fmt.end_tokens)
        self.producer.note_reasoning(phases.tokens, by)

    def close_phases(self) -> None:
        """A request that ends inside its reasoning: the trace gets the phase's count."""
        phases = self.phases
        if phases is not None and phases.state == REASONING:
            self.producer.note_reasoning(phases.tokens)
            phases.state = ANSWER  # counted once

    def _split(self, phases: PhaseSplitter, token: int, text: str) -> tuple[str, str]:
        """A thinking model's token: (reasoning, answer) text, and the phase's marks."""
        text = self.markers.get(token, text)
        was, had = phases.state, phases.opened
        reasoning, answer = phases.feed(text)
        if phases.opened and was == ANSWER and not phases.answered:
            phases.answered = True  # the first token after the end marker: the answer's
            self.producer.note_answer()
        if not phases.opened or was == ANSWER:
            return reasoning, answer
        if not had or not phases.tokens:
            # Opened by the model's marker, or by the prompt: the clock starts at its
            # first generated token (the prompt's prefill is not thinking).
            self.producer.note_reasoning(0)
            if self.on_thinking is not None:
                self.on_thinking(self)
        phases.tokens += 1  # the markers are the reasoning's tokens too
        if phases.state == ANSWER:
            self.think_until = None
            self.producer.note_reasoning(phases.tokens, "marker")
        return reasoning, answer

    # -- a sampled token ---------------------------------------------------------------------

    def tail(self) -> tuple[str, str]:
        """What the reply held back when it ends: (reasoning, answer)."""
        answer = held_back(self.stopper, self.decoder)
        if self.phases is None:
            return "", answer
        reasoning, more = self.phases.flush()
        return reasoning, answer + more

    def accept(self, token: int, raw: bytes, *, end: bool) -> Accepted:
        """What the sampled ``token`` (its bytes ``raw``; ``end``: an end-of-generation
        token) becomes: its text through the phases and the stop strings, and whether
        it ends the request (an end token, a stop string, ``max_tokens``). A token that
        does not end it is appended; a reasoning budget reached by it ends the phase."""
        if end:
            reasoning, tail = self.tail()
            return Accepted(tail, reasoning, EndReason.STOP, scored=False)
        self.produced += 1
        self.producer.count_token()
        text = self.decoder.decode(raw)
        reasoning = ""
        phases = self.phases
        if phases is not None:
            reasoning, text = self._split(phases, token, text)
        # Stop strings are the answer's: the reasoning part never reaches them.
        text, hit = self.stopper.feed(text)
        if hit:
            self.producer.trace.stop_sequence = self.stopper.matched
            return Accepted(text, reasoning, EndReason.STOP)
        if self.produced >= self.max_new:
            more, tail = self.tail()
            return Accepted(text + tail, reasoning + more, EndReason.LENGTH)
        self.tokens.append(token)
        if (
            phases is not None
            and phases.state == REASONING
            and self.think_budget is not None
            and phases.tokens >= self.think_budget
        ):
            self.end_reasoning("budget")
        return Accepted(text, reasoning, None)


class ThinkingDeadline:
    """A sequence's thinking deadline, as the engine's ``DeadlineTimer`` sees it: at its
    time, ``expired(seq)`` runs (the engine aborts the step in flight if it computes
    this sequence alone, so the end marker goes into the very next step)."""

    __slots__ = ("__weakref__", "expired", "seq")

    def __init__(self, seq: Sequence, expired: Callable[[Sequence], None]) -> None:
        self.seq = seq
        self.expired = expired

    def expire(self) -> float | None:
        when = self.seq.think_until
        if when is None:
            return None  # the phase ended before its deadline
        if time.monotonic() < when:
            return when
        self.expired(self.seq)
        return None
