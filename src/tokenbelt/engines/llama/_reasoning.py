"""A thinking model's reasoning phase: its markers, and the split of its output.

``detect_reasoning`` reads the markers from the GGUF's chat template (a template that
writes ``<think>`` and ``</think>`` is a thinking model's) and takes the end marker's
tokens from the vocabulary: one token where the vocabulary has it as a special token
(Qwen3, DeepSeek-R1), else the tokenized marker text (what the model would write).
Whether a request's reasoning opens in the prompt is read per request from the prompt
itself (``opens_in``): a template that opens the section in its generation prompt
(Qwen3-2507, a ``think`` switch) ends the prompt inside it, one that closes it (Qwen3
with ``enable_thinking=false``) does not, and a model that writes the start marker
itself is seen doing so (``PhaseSplitter``'s ``pending`` state).

``PhaseSplitter`` turns a sequence's text into (reasoning, answer) parts as it comes,
holding back text that may be the start of a marker, as ``StopMatcher`` holds back
the start of a stop string. Stop strings only ever see the answer part.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .._request import NO_LEVELS_ADVICE, NO_PHASE_ADVICE

#: the markers tokenbelt knows: (start, end), in the order they are looked for
MARKERS = (("<think>", "</think>"),)

#: the phases of a sequence's output
PENDING, REASONING, ANSWER = "pending", "reasoning", "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    """A thinking model's markers, and what its template lets a request choose."""

    start: str
    end: str
    #: what the engine appends to end the phase (budget, deadline, ``think=False``):
    #: the end marker and the white space the template writes after it (``end_text``)
    end_tokens: tuple[int, ...]
    #: the template reads ``enable_thinking`` (Qwen3): ``think`` is passed to it
    toggle: bool
    #: the template reads ``reasoning_effort`` (gpt-oss): effort levels are passed to it
    efforts: bool
    #: the text of ``end_tokens``
    end_text: str = ""

    def opens_in(self, prompt: str) -> bool:
        """Whether ``prompt`` ends inside an open reasoning section (the template
        opened it in the generation prompt)."""
        at = prompt.rfind(self.start)
        if at < 0 or prompt.rfind(self.end) > at:
            return False
        return not prompt[at + len(self.start) :].strip()


@functools.lru_cache(maxsize=16)
def _template_reads(template: str) -> frozenset[str]:
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateError:
        return frozenset()


def detect_reasoning(model: Any, formatter: Any) -> ReasoningFormat | None:
    """The reasoning markers of a model's chat template, or None for a model without them.

    ``model`` is llama-cpp-python's ``_internals.LlamaModel`` (a vocabulary-only one is
    enough); ``formatter`` the chat formatter made from its template.
    """
    template = getattr(formatter, "template", None)
    if not isinstance(template, str):
        return None
    for start, end in MARKERS:
        if start in template and end in template:
            # The white space after the marker too: forced with it, the answer's first
            # word is the very next token sampled, not two newlines later.
            text = end + separator_after(template, end)
            tokens = tuple(int(t) for t in model.tokenize(text.encode("utf-8"), False, True))
            reads = _template_reads(template)
            return ReasoningFormat(
                start=start,
                end=end,
                end_tokens=tokens,
                toggle="enable_thinking" in reads,
                efforts="reasoning_effort" in reads,
                end_text=text,
            )
    return None


def separator_after(template: str, marker: str) -> str:
    r"""The white space a chat template writes right after ``marker`` where it closes a
    reasoning section itself (Qwen3's and DeepSeek-R1's ``</think>\n\n``): newlines,
    literal or ``\n`` escapes inside a Jinja string, at most two, after the first
    occurrence that has any (Qwen3's template also names the marker in a ``split``, with
    nothing after it). Empty when the template writes none there."""
    at = template.find(marker)
    while at >= 0:
        rest, found = template[at + len(marker) :], ""
        while len(found) < 2:
            if rest.startswith("\\n"):
                found, rest = found + "\n", rest[2:]
            elif rest.startswith("\n"):
                found, rest = found + "\n", rest[1:]
            else:
                break
        if found:
            return found
        at = template.find(marker, at + 1)
    return ""


def template_options(fmt: ReasoningFormat | None, think: bool | str | None) -> dict[str, Any]:
    """What a request's ``think`` passes to the chat template (its own variables only)."""
    if fmt is None or think is None:
        return {}
    if isinstance(think, str):
        return {"reasoning_effort": think} if fmt.efforts else {}
    return {"enable_thinking": think} if fmt.toggle else {}


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may start ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class PhaseSplitter:
    """One sequence's output split into its reasoning and answer parts.

    ``feed(text)`` returns (reasoning text, answer text) safe to show now; ``state``
    says the phase the output is in: ``pending`` (the model may still open its
    reasoning: only whitespace so far), ``reasoning`` or ``answer``. The markers
    themselves are never shown, nor the whitespace that starts either part.
    """

    __slots__ = ("_carry", "_fmt", "_held", "_lead", "answered", "opened", "state", "tokens")

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        self._fmt = fmt
        self.state = REASONING if opened else PENDING
        #: whether the reasoning phase has opened (in the prompt, or by the model)
        self.opened = opened
        self._held = ""
        self._lead = True  # the current part has shown nothing yet: strip its whitespace
        self._carry = ""  # reasoning text held when the phase was ended: shown next
        #: tokens generated in the reasoning phase
        self.tokens = 0
        #: whether a token was generated after the reasoning ended (the answer's first)
        self.answered = False

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, answer = self._carry, ""
        self._carry = ""
        buf, self._held = self._held + text, ""
        while True:
            if self.state == PENDING:
                rest = buf.lstrip()
                if rest.startswith(self._fmt.start):
                    self.state = REASONING
                    self.opened = True
                    buf = rest[len(self._fmt.start) :]
                    continue
                if self._fmt.start.startswith(rest):
                    self._held = buf  # whitespace, or the start marker's beginning
                    break
                self.state = ANSWER
                continue
            if self.state == REASONING:
                at = buf.find(self._fmt.end)
                if at >= 0:
                    reasoning += self._show(buf[:at])
                    buf = buf[at + len(self._fmt.end) :]
                    self._switch()
                    continue
                keep = _partial(buf, self._fmt.end)
                reasoning += self._show(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            answer += self._show(buf)
            break
        return reasoning, answer

    def _show(self, text: str) -> str:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        return text

    def _switch(self) -> None:
        self.state = ANSWER
        self._lead = True

    def end_now(self) -> None:
        """End the reasoning phase here (its end marker is being forced); the reasoning
        text still held back (a marker's beginning that was not one) comes with the
        next ``feed`` or ``flush``."""
        held, self._held = self._held, ""
        if self.state == REASONING:
            self._carry += self._show(held)
        self._switch()

    def flush(self) -> tuple[str, str]:
        """The output ends: what was held back, as (reasoning, answer)."""
        held, self._held = self._held, ""
        carry, self._carry = self._carry, ""
        if self.state == REASONING:
            return carry + self._show(held), ""
        return carry, self._show(held)


def check_reasoning(fmt: ReasoningFormat | None, request: Any, name: str) -> None:
    """What a request's ``think`` asks of the model, checked before it queues
    (``InvalidArgument`` naming ``think``). A budget or a deadline is a bound, not a
    demand: on a model that never thinks it is never reached."""
    from ..._errors import InvalidArgument

    think = request.sampling.think
    if think is None or think is False:
        return
    if request.messages is None:
        raise InvalidArgument(
            "think goes with chat messages: a raw prompt is the model's input as written",
            param="think",
        )
    if fmt is None:
        raise InvalidArgument(
            f"think: {name} has no thinking phase (its chat template writes no "
            f"<think> markers); {NO_PHASE_ADVICE}",
            param="think",
        )
    if isinstance(think, str) and not fmt.efforts:
        raise InvalidArgument(
            f"think: {name}'s chat template takes no effort level (it reads no "
            f"reasoning_effort); {NO_LEVELS_ADVICE}, not {think!r}",
            param="think",
        )
