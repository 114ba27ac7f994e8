"""What a request asks for: the vocabulary every engine and surface shares.

Chat ``Message``s or a raw prompt, ``SamplingParams`` (validated on construction, with
``sampling_from`` to build them from OpenAI-named keywords), an optional ``Grammar``,
and the ``Piece``/``TokenLogprob`` items an engine puts on the belt when log-probabilities
were asked for. ``refuse``/``refuse_grammar`` let an engine turn down what it cannot
honour: a parameter is never silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from .._defaults import DEFAULT_MAX_TOKENS
from .._errors import InvalidArgument
from ..belt import RANGES, check


class Message(TypedDict):
    """One chat message, as in the OpenAI API (``name``: the speaker, when given)."""

    role: str
    content: str
    name: NotRequired[str]
    #: an assistant turn's calls, for a chat template that renders tools: OpenAI-shaped
    #: ``{"id", "type", "function": {"name", "arguments"}}`` with the arguments an object
    tool_calls: NotRequired[list[dict[str, Any]]]
    #: a ``tool`` turn's call, for a chat template that renders tools
    tool_call_id: NotRequired[str]


#: the roles a chat message may have (the HTTP surface maps ``developer`` to ``system``)
ROLES = ("system", "user", "assistant", "tool")
#: most alternatives ``top_logprobs`` may ask for, as in the OpenAI API
MAX_TOP_LOGPROBS = int(RANGES["top_logprobs"].high)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token with its log-probability, and the likeliest alternatives.

    ``logprob`` is the model's own (a log-softmax of the raw logits, before penalties,
    bias and temperature): what the model thought, whatever the sampler then chose.
    ``top`` holds the ``top_logprobs`` likeliest tokens at that step, likeliest first.
    """

    token: str
    logprob: float
    #: the token's UTF-8 bytes (a token may hold part of a character)
    bytes: bytes
    top: tuple[TokenLogprob, ...] = ()


class Piece(str):
    """A text piece that carries what a plain string cannot: the log-probabilities of the
    tokens it came from, and the reasoning text of a thinking model.

    An engine puts these on the belt instead of plain strings only when a request asked
    for ``logprobs``, ``return_token_ids`` or the model thinks: it is still a ``str``
    everywhere text is read (the answer's text), and the plain path pays nothing.
    ``reasoning`` is the text of the reasoning phase this piece carries (before its answer
    text, when a piece holds the end of one and the start of the other); ``part`` says
    which part a piece belongs to. Either text may be empty (a token held back for a stop
    string, a marker or an unfinished character) while ``logprobs`` is not. Picklable.
    """

    logprobs: tuple[TokenLogprob, ...]
    reasoning: str
    #: the ids of the tokens it came from, when the request asked for ``return_token_ids``
    token_ids: tuple[int, ...]

    def __new__(
        cls,
        text: str,
        logprobs: tuple[TokenLogprob, ...] = (),
        reasoning: str = "",
        token_ids: tuple[int, ...] = (),
    ) -> Piece:
        piece = super().__new__(cls, text)
        piece.logprobs = logprobs
        piece.reasoning = reasoning
        piece.token_ids = token_ids
        return piece

    @property
    def part(self) -> str:
        """``reasoning`` for a piece of the reasoning phase only, else ``answer``."""
        return "reasoning" if self.reasoning and not str(self) else "answer"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Piece, (str(self), self.logprobs, self.reasoning, self.token_ids))


def _number(name: str, value: object, param: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidArgument(f"{name} must be a number, got {value!r}", param=param or name)
    return float(value)


#: The one set of sampling ranges: the SDK, the CLI and the HTTP API all accept exactly
#: these (name -> (lowest, highest, whether the lowest itself is allowed)); the counts
#: among them are the range table's (``tokenbelt.belt.RANGES``).
SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    "max_tokens": (RANGES["max_tokens"].low, RANGES["max_tokens"].high, True),
    "temperature": (0.0, 2.0, True),
    "top_p": (0.0, 1.0, False),
    "top_k": (RANGES["top_k"].low, RANGES["top_k"].high, True),
    "min_p": (0.0, 1.0, True),
    "repeat_penalty": (0.0, 10.0, False),
    "seed": (RANGES["seed"].low, RANGES["seed"].high, True),
}
#: the most stop sequences one request may give
MAX_STOP = 16


def check_text(what: str, text: str) -> None:
    """Refuse text that cannot be UTF-8 (a lone UTF-16 surrogate such as JSON ``"\\ud800"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise InvalidArgument(
            f"{what} is not valid Unicode: a lone surrogate {bad!a} at position {exc.start}"
        ) from None


def _in_range(name: str, value: float) -> None:
    low, high, low_included = SAMPLING_RANGES[name]
    if not ((low <= value if low_included else low < value) and value <= high):
        opening = "[" if low_included else "("
        raise InvalidArgument(
            f"{name} must be in {opening}{_plain(low)}, {_plain(high)}], got {value!r}"
        )


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, named as in the OpenAI API where one exists.

    Validated on construction: a bad value raises ``InvalidArgument`` before any
    compute is spent.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    #: the last tokens ``repeat_penalty`` looks at (Ollama's ``repeat_last_n``: 0 off,
    #: -1 the whole context)
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: OpenAI's: minus ``frequency_penalty`` times how often a token was generated so far
    frequency_penalty: float = 0.0
    #: OpenAI's: minus ``presence_penalty`` for every token generated at least once
    presence_penalty: float = 0.0
    #: (token id, bias) pairs added to the logits; -100 bans a token, +100 forces it
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: return each generated token's log-probability (``Piece`` items on the belt)
    logprobs: bool = False
    #: with ``logprobs``, also the this many likeliest tokens of each step (0 to 20)
    top_logprobs: int = 0
    #: end-of-generation tokens are banned: the reply runs to ``max_tokens`` (or a stop string)
    ignore_eos: bool = False
    #: end-of-generation tokens are banned until this many tokens were generated
    min_tokens: int = 0
    #: each piece carries the ids of the tokens it came from (``Piece.token_ids``)
    return_token_ids: bool = False
    #: a thinking model's reasoning phase: at most this many tokens, then its end marker
    #: is forced and the answer starts (None: no budget; 0: the answer starts at once)
    reasoning_budget: int | None = None
    #: seconds the reasoning phase may last from its start; then, as for the budget, the
    #: end marker is forced and the answer starts (the request itself goes on)
    reasoning_timeout: float | None = None
    #: True/False: a thinking model thinks or answers at once (None: the model's way);
    #: an effort level (``REASONING_EFFORTS``) for a template that reads one
    think: bool | str | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k", "min_tokens", "top_logprobs", "repeat_last_n"):
            check(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            _in_range(name, _number(name, getattr(self, name)))
        if self.seed is not None:
            check("seed", self.seed)
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgument("stop must be a string or a list of non-empty strings")
        if len(stop) > MAX_STOP:
            raise InvalidArgument(f"stop holds at most {MAX_STOP} strings, got {len(stop)}")
        for text in stop:
            check_text("stop", text)
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= _number(name, getattr(self, name)) <= 2.0:
                raise InvalidArgument(
                    f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name
                )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not isinstance(self.logprobs, bool):
            raise InvalidArgument(
                f"logprobs must be true or false, got {self.logprobs!r}", param="logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs to be true", param="top_logprobs")
        for name in ("ignore_eos", "return_token_ids"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(
                    f"{name} must be true or false, got {getattr(self, name)!r}", param=name
                )
        least = self.min_tokens
        if least > self.max_tokens:
            raise InvalidArgument(
                f"min_tokens ({least}) must not be more than max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        _check_reasoning(self)


#: the effort levels ``think`` may name (gpt-oss's, as Ollama and OpenAI name them)
REASONING_EFFORTS = ("low", "medium", "high")
#: how an engine's refusal of a ``think`` ends: each API's route says the same in its own
#: field's values (``server.core.think_said_as``)
NO_PHASE_ADVICE = "send false or leave it out"
NO_LEVELS_ADVICE = "send true or false"
#: the largest reasoning budget, in tokens
MAX_REASONING_BUDGET = int(RANGES["reasoning_budget"].high)


def _check_reasoning(s: SamplingParams) -> None:
    if s.reasoning_budget is not None:
        check("reasoning_budget", s.reasoning_budget)
    if s.reasoning_timeout is not None:
        check("timeout", s.reasoning_timeout, label="reasoning_timeout")
    if s.think is not None and not isinstance(s.think, bool) and s.think not in REASONING_EFFORTS:
        raise InvalidArgument(
            f"think must be true, false or one of {', '.join(REASONING_EFFORTS)}, got {s.think!r}",
            param="think",
        )


def refuse(s: SamplingParams, engine: str, *names: str) -> None:
    """Raise ``InvalidArgument`` (naming the parameter) if ``s`` uses one of ``names``,
    which ``engine`` cannot honour: a parameter is never silently ignored."""
    for name in names:
        if getattr(s, name) != SamplingParams.__dataclass_fields__[name].default:
            raise InvalidArgument(f"{name} is not supported by the {engine} engine", param=name)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (token ids may be strings, as JSON keys are) or pairs, checked;
    kept as sorted pairs so the parameters stay hashable and picklable."""
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, Iterable) or isinstance(items, str | bytes):
        raise InvalidArgument(
            f"logit_bias must map token ids to biases, got {value!r}", param="logit_bias"
        )
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidArgument(
                f"logit_bias must map token ids to biases, got {value!r}", param="logit_bias"
            )
        token, bias = item
        try:
            token_id = int(token) if isinstance(token, str | int) else -1
        except ValueError:
            token_id = -1
        if isinstance(token, bool) or token_id < 0:
            raise InvalidArgument(
                f"logit_bias keys must be token ids (integers >= 0), got {token!r}",
                param="logit_bias",
            )
        if not -100.0 <= _number("a logit_bias value", bias, "logit_bias") <= 100.0:
            raise InvalidArgument(
                f"logit_bias values must be in [-100, 100], got {bias!r}", param="logit_bias"
            )
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar for one request; plain strings, so it pickles.

    With ``triggers`` the grammar is lazy: text is free until the output matches one of
    the patterns (a full match of everything so far, ECMAScript regex); from the first
    capture group of that match on, the grammar applies.
    """

    gbnf: str
    root: str = "root"
    triggers: tuple[str, ...] = ()
    #: seconds the compilation took (0.0 when it came from the cache)
    compile_s: float = field(default=0.0, compare=False)
    #: whether the compiled text came from the cache
    cached: bool = field(default=False, compare=False)


#: the keyword arguments ``sampling_from`` accepts: the fields of ``SamplingParams``
SAMPLING_KEYS = frozenset(SamplingParams.__dataclass_fields__)


def sampling_from(params: dict[str, Any], defaults: SamplingParams | None = None) -> SamplingParams:
    """Build validated ``SamplingParams`` from OpenAI-named keyword arguments."""
    unknown = set(params) - SAMPLING_KEYS
    if unknown:
        raise InvalidArgument(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    base = defaults or SamplingParams()
    merged = {k: getattr(base, k) for k in SAMPLING_KEYS}
    merged.update({k: v for k, v in params.items() if v is not None})
    if isinstance(merged["stop"], str):
        merged["stop"] = (merged["stop"],)
    elif merged["stop"] is not None:
        merged["stop"] = tuple(merged["stop"])
    return SamplingParams(**merged)


#: the drafting an engine may do (``off``: none; ``lookup``: n-grams of the sequence itself)
DRAFT_MODES = ("lookup", "off")


def check_draft(value: object, *, allow_none: bool = False) -> None:
    """Refuse a drafting mode that is not one of ``DRAFT_MODES`` (``InvalidArgument``)."""
    if value is None and allow_none:
        return
    if value not in DRAFT_MODES:
        raise InvalidArgument(
            f"draft must be one of {', '.join(DRAFT_MODES)}, got {value!r}", param="draft"
        )


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: chat ``messages``, a raw ``prompt``, or a raw prompt given as
    token ids of the model's vocabulary, ``prompt_tokens`` (exactly one of them).

    ``conversation_id`` lets an engine keep the KV cache of a conversation's prefix
    between its turns; requests of other conversations never see that state.
    ``grammar`` constrains sampling (structured output, tool calls); an engine that
    cannot apply it refuses the request with ``InvalidArgument`` before any compute.
    ``tools`` (JSON text of a list of OpenAI-shaped tools; text so that a request stays
    cheap to pickle) goes to a chat template that renders tools (``template_tools`` on
    the engine); other engines ignore it, the tools being described in the messages.
    ``reuse_prefix=False`` (llama.cpp's ``cache_prompt: false``) computes the whole
    prompt even when a cached or running sequence shares a prefix with it.
    ``draft`` (``DRAFT_MODES``; None: the engine's own setting) asks for prompt-lookup
    drafting (``lookup``) or none (``off``); it changes the speed, never the text.
    ``continue_final``: the messages end with an assistant turn that the reply continues
    (Anthropic's prefill) instead of a new turn after it.
    ``infill``: the prompt is a fill-in-the-middle one (``Model.infill_request`` makes
    it): the request is a code completion, and its trace and the model's completion
    statistics count it as one; engines read the prompt as any other.
    """

    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    conversation_id: str | None = None
    grammar: Grammar | None = None
    tools: str | None = None
    reuse_prefix: bool = True
    draft: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    continue_final: bool = False
    infill: bool = False

    def __post_init__(self) -> None:
        check_draft(self.draft, allow_none=True)
        given = (self.messages, self.prompt, self.prompt_tokens)
        if sum(part is not None for part in given) != 1:
            raise InvalidArgument("give either messages, a prompt or prompt_tokens")
        if self.tools is not None and self.messages is None:
            raise InvalidArgument("tools go with chat messages, not a raw prompt")
        if isinstance(self.messages, str):
            raise InvalidArgument(
                "messages is a list of {'role': ..., 'content': ...} dicts, not a string; "
                "pass [{'role': 'user', 'content': text}] (or prompt=text for a raw prompt)"
            )
        if self.messages is not None:
            for m in self.messages:
                if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                    raise InvalidArgument(f"each message needs a string content, got {m!r}")
                if m.get("role") not in ROLES:
                    raise InvalidArgument(f"unknown message role {m.get('role')!r}")
                check_text("message content", m["content"])
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise InvalidArgument(f"prompt must be a string, got {self.prompt!r}")
            if not self.prompt:
                # No token to start from: llama.cpp cannot decode an empty batch.
                raise InvalidArgument("prompt is empty: give at least one character of text")
            check_text("prompt", self.prompt)
        if self.continue_final and (
            not self.messages
            or self.messages[-1].get("role") != "assistant"
            or not self.messages[-1]["content"].strip()
        ):
            raise InvalidArgument(
                "continue_final continues a final assistant turn with text: the messages "
                "must end with one",
                param="messages",
            )
        if self.prompt_tokens is not None:
            tokens = self.prompt_tokens
            if not isinstance(tokens, tuple) or not tokens:
                raise InvalidArgument(
                    "prompt_tokens is a non-empty tuple of token ids", param="prompt"
                )
            for token in tokens:
                if type(token) is not int or token < 0:
                    raise InvalidArgument(
                        f"prompt_tokens holds token ids (integers >= 0), got {token!r}",
                        param="prompt",
                    )

    @classmethod
    def chat(
        cls,
        messages: Sequence[Message],
        sampling: SamplingParams | None = None,
        conversation_id: str | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationRequest:
        return cls(
            messages=tuple(messages),
            sampling=sampling or SamplingParams(),
            conversation_id=conversation_id,
            grammar=grammar,
        )


def refuse_grammar(request: GenerationRequest, engine: str) -> None:
    """For an engine that cannot constrain sampling: a grammar is an error, never ignored."""
    if request.grammar is not None:
        raise InvalidArgument(f"{engine} cannot constrain output with a grammar")
