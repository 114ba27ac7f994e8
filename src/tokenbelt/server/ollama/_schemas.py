"""Request bodies of the Ollama API, and how their options map to tokenbelt's.

Every field Ollama defines is declared, so that one tokenbelt cannot honour is
refused by name (``UnsupportedParameter``, a 400) instead of being dropped; unknown
fields are refused by pydantic (``extra="forbid"``). A field sent with its "off"
value (``tools: []``, ``think: false``, ``format: ""``, what the ``ollama`` client
sends by default) asks for nothing and is accepted. ``tools`` are OpenAI-shaped
functions, as in Ollama; ``messages`` may hold an assistant's ``tool_calls`` and
``tool`` turns (``tool_name``), translated by ``ChatRequest.turns`` for the planner.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..._errors import InvalidArgument
from ...belt import MAX_KEEP_ALIVE_S, check
from ...engines import Grammar, json_object_grammar, schema_grammar
from ..core import Fit, TokenbeltOptions, UnsupportedParameter, ranges

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def error_shape(
    status: int, message: str, type_: str, code: str | None, param: str | None
) -> tuple[int, dict[str, Any]]:
    """Ollama's error body, ``{"error": "..."}``; a malformed body is a 400, as in Ollama."""
    return (400 if status == 422 else status), {"error": message}


_AT_LOAD = "is set when the model loads, for every request, not by one; leave it out"
#: Ollama's options that are no request's to set here, and why (the server's flag, if any)
_NOT_PER_REQUEST: dict[str, str] = {
    "num_thread": "the decode threads are set when the model loads: tokenbelt serve --threads "
    "(and --threads-batch); leave it out",
    "num_gpu": "the layers a GPU holds " + _AT_LOAD,
    "main_gpu": "the GPU a model uses " + _AT_LOAD,
    "num_batch": "the prompt tokens a step takes are set when the model loads: tokenbelt serve "
    "--prefill-chunk; leave it out",
    "use_mmap": "how the weights are read " + _AT_LOAD,
    "use_mlock": "whether the weights are locked in memory " + _AT_LOAD,
    "numa": "the NUMA policy " + _AT_LOAD,
    "num_keep": "tokenbelt never shifts tokens out of a context: a chat outgrowing num_ctx "
    "loses whole turns, its system messages kept; leave it out",
    "tfs_z": "tail-free sampling is gone from llama.cpp (and Ollama ignores it); leave it out",
}


class Options(BaseModel):
    """``options``: the sampling and context settings tokenbelt can honour."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: ranges.Temperature = None
    top_p: ranges.TopP = None
    top_k: ranges.TopK = None
    min_p: ranges.MinP = None
    repeat_penalty: ranges.RepeatPenalty = None
    repeat_last_n: int | None = ranges.bounded(
        "repeat_last_n", description="the last tokens repeat_penalty looks at (0 off, -1 all)"
    )
    frequency_penalty: ranges.Penalty = None
    presence_penalty: ranges.Penalty = None
    mirostat: int | None = Field(None, description="only 0 (off), Ollama's default")
    typical_p: float | None = Field(None, description="only 1.0 (off), Ollama's default")
    seed: ranges.Seed = None
    stop: ranges.Stop = None
    num_predict: int | None = ranges.bounded(
        "num_predict", description="tokens to generate; -1 or -2: up to the context"
    )
    num_ctx: int | None = ranges.bounded(
        "num_ctx",
        description="the chat's window: its oldest turns are left out beyond it; larger "
        "than the loaded context, a chat that does not fit that is refused",
    )

    # Ollama's settings of a load, not of a request: refused with where each is set here
    # (null, as clients send an unset one, is taken).
    num_thread: int | None = Field(None, description="refused: tokenbelt serve --threads")
    num_gpu: int | None = Field(None, description="refused: set when a model loads")
    main_gpu: int | None = Field(None, description="refused: set when a model loads")
    num_batch: int | None = Field(None, description="refused: tokenbelt serve --prefill-chunk")
    use_mmap: bool | None = Field(None, description="refused: set when a model loads")
    use_mlock: bool | None = Field(None, description="refused: set when a model loads")
    numa: bool | None = Field(None, description="refused: set when a model loads")
    num_keep: int | None = Field(None, description="refused: nothing is shifted out by tokens")
    tfs_z: float | None = Field(None, description="refused: gone from llama.cpp and Ollama")

    @field_validator("mirostat", "typical_p")
    @classmethod
    def _off(cls, value: float | None, info: ValidationInfo) -> float | None:
        off, what = _OFF[str(info.field_name)]
        if value not in (None, off):
            raise ValueError(f"got {value}: tokenbelt samples without {what} (only {off}, off)")
        return value

    @field_validator(*_NOT_PER_REQUEST)
    @classmethod
    def _not_per_request(cls, value: object, info: ValidationInfo) -> object:
        if value is not None:
            raise ValueError(_NOT_PER_REQUEST[str(info.field_name)])
        return value


_NO_LOGPROBS = (
    "tokenbelt returns no log probabilities on Ollama's routes; its OpenAI chat "
    "completions return them (logprobs, top_logprobs)"
)

#: options tokenbelt takes only at Ollama's default, which turns them off: (that, what)
_OFF: dict[str, tuple[float, str]] = {
    "mirostat": (0, "mirostat"),
    "typical_p": (1.0, "typical sampling"),
}


class _Generation(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field("", max_length=200, description="a model's name; empty: the first")
    stream: bool = True
    options: Options | None = None
    format: Literal["json", ""] | dict[str, Any] | None = Field(
        None, description='"json" or a JSON schema: the reply is constrained to it'
    )
    keep_alive: float | str | None = Field(
        None, description="how long the model stays loaded after this request; 0 unloads"
    )
    think: bool | str | None = Field(
        None,
        description="a thinking model: true or false, or an effort level (low, medium, "
        "high) for a template that reads one; its reasoning comes as thinking",
    )
    logprobs: bool | None = None
    top_logprobs: int | None = ranges.bounded("top_logprobs")
    tokenbelt: TokenbeltOptions | None = None
    # Sent at the top level by some clients (ollama-ai-provider-v2, the AI SDK's Ollama
    # provider): Ollama ignores them; tokenbelt honours each as the option it stands for.
    temperature: ranges.Temperature = Field(None, description="options.temperature, here")
    top_p: ranges.TopP = Field(None, description="options.top_p, here")
    max_output_tokens: int | None = Field(None, ge=1, description="options.num_predict, here")

    def merged_options(self) -> Options:
        """``options`` with ``temperature``, ``top_p`` and ``max_output_tokens`` (as
        ``num_predict``) from the top level; a value given both ways differently is an
        ``InvalidArgument`` naming both."""
        options = self.options or Options.model_validate({})
        moved = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "num_predict": self.max_output_tokens,
        }
        moved = {k: v for k, v in moved.items() if v is not None}
        for option, value in moved.items():
            there = getattr(options, option)
            if there is not None and there != value:
                top = "max_output_tokens" if option == "num_predict" else option
                raise InvalidArgument(
                    f"{top} {value} and options.{option} {there} disagree: send one of them",
                    param=top,
                )
        return options.model_copy(update=moved) if moved else options

    def grammar(self) -> Grammar | None:
        """The grammar ``format`` asks for; ``UnsupportedParameter`` if it cannot be had."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return json_object_grammar()
        if not isinstance(self.format, dict):
            raise UnsupportedParameter("format", 'it is "json" or a JSON schema object')
        try:
            return schema_grammar(self.format)
        except InvalidArgument as exc:
            raise UnsupportedParameter("format", str(exc)) from exc

    def check_supported(self) -> None:
        """Raise ``UnsupportedParameter`` for a field set to something tokenbelt can't do."""
        self.grammar()
        for name in ("logprobs", "top_logprobs"):
            if getattr(self, name):
                raise UnsupportedParameter(name, _NO_LOGPROBS)

    def fit(self, context_length: int) -> Fit:
        """The window a chat's prompt and reply fit in: ``num_ctx``, else the context."""
        o = self.options
        if o is None or o.num_ctx is None:
            return Fit(context_length)
        if o.num_ctx > context_length:
            return Fit(context_length, "options.num_ctx", asked=o.num_ctx)
        return Fit(o.num_ctx, "options.num_ctx")

    def sampling(self, context_length: int) -> dict[str, object]:
        """The runtime's sampling keyword arguments (None = its default)."""
        o = self.merged_options()
        max_tokens = o.num_predict
        if max_tokens == 0:
            raise UnsupportedParameter("options.num_predict", "0 tokens: it must be >= 1, -1 or -2")
        if max_tokens is not None and max_tokens < 0:
            max_tokens = context_length  # "until the context is full": the engine stops there
        return {
            "max_tokens": max_tokens,
            "temperature": o.temperature,
            "top_p": o.top_p,
            "top_k": o.top_k,
            "min_p": o.min_p,
            "repeat_penalty": o.repeat_penalty,
            "repeat_last_n": o.repeat_last_n,
            "frequency_penalty": o.frequency_penalty,
            "presence_penalty": o.presence_penalty,
            "seed": o.seed,
            "stop": [o.stop] if isinstance(o.stop, str) else o.stop,
            "think": self.think,
        }

    def keep_alive_seconds(self) -> float | Literal[False] | None:
        """``keep_alive`` in seconds; None keeps the model for ever; False when not given."""
        return parse_keep_alive(self.keep_alive)


def parse_keep_alive(value: float | str | None) -> float | Literal[False] | None:
    """Ollama's ``keep_alive``: seconds, or a duration such as ``"5m"`` or ``"1h30m"``.

    A negative value keeps the model loaded for ever (``None``); no value gives False.
    """
    if value is None:
        return False
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not text or "".join(n + u for n, u in parts) != text:
                raise UnsupportedParameter(
                    "keep_alive", f"{value!r} is not a duration such as 30s, 5m or 1h"
                ) from None
            seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
        seconds *= sign
    else:
        seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise UnsupportedParameter("keep_alive", f"{value!r} is not a duration")
    if abs(seconds) > MAX_KEEP_ALIVE_S:
        raise UnsupportedParameter(
            "keep_alive",
            f"{value!r} is out of range: at most {MAX_KEEP_ALIVE_S:.0f} seconds (365 days) "
            "either way (a negative value keeps the model loaded for ever)",
        )
    return None if seconds < 0 else seconds


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    #: the call's place in its turn (Ollama >= 0.12 sends it)
    index: int | None = None


class ToolCallIn(BaseModel):
    """A call in an assistant message the client sends back."""

    model_config = ConfigDict(extra="forbid", strict=True)

    function: CallFunction
    id: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    #: an earlier turn's reasoning: taken, and left out of the prompt (as Qwen3's and
    #: DeepSeek-R1's templates drop it) so that a client may send its history back whole
    thinking: str | None = None


class ChatRequest(_Generation):
    """``POST /api/chat``."""

    messages: list[ChatMessage] = Field(default_factory=list, max_length=4096)
    tools: list[dict[str, Any]] | None = Field(None, max_length=1024)
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="not Ollama's (which has none; ollama-ai-provider-v2 sends it): auto, "
        'none, required, or {"type": "function", "name": ...}',
    )

    def choice(self) -> object:
        """``tool_choice`` as the tool planner takes it (OpenAI's named shape)."""
        c = self.tool_choice
        if isinstance(c, dict) and c.get("type") == "function" and "function" not in c:
            return {"type": "function", "function": {"name": c.get("name")}}
        return c

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools and self.format not in (None, ""):
            raise UnsupportedParameter(
                "format", "together with tools on /api/chat: send one or the other"
            )
        for i, m in enumerate(self.messages):
            if m.images:
                raise UnsupportedParameter(f"messages[{i}].images")
            if m.tool_calls and m.role != "assistant":
                raise UnsupportedParameter(
                    f"messages[{i}].tool_calls", f"tool calls come in assistant turns, not {m.role}"
                )

    def turns(self) -> list[dict[str, Any]]:
        """The messages as OpenAI-shaped dicts for the tool planner: an assistant's
        ``tool_calls`` with their arguments as JSON text, a ``tool`` turn as it is."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            turn: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                turn["tool_calls"] = [
                    {
                        "id": c.id or f"call_{i}_{j}",
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": c.function.arguments
                            if isinstance(c.function.arguments, str)
                            else json.dumps(c.function.arguments, ensure_ascii=False),
                        },
                    }
                    for j, c in enumerate(m.tool_calls)
                ]
            if m.role == "tool" and m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            out.append(turn)
        return out


class GenerateRequest(_Generation):
    """``POST /api/generate``."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    #: fill in the middle: the text after the completion (the prompt is the text before)
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None
    # Ollama's image generation: not served here, so null (or absent) is the one value.
    width: None = Field(None, description="image generation: not served, only null")
    height: None = Field(None, description="image generation: not served, only null")
    steps: None = Field(None, description="image generation: not served, only null")

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None and self.system:
            raise UnsupportedParameter("system", "with a suffix (a fill-in-the-middle prompt)")
        if self.template:
            raise UnsupportedParameter("template", "the model's own chat template is used")
        if self.context:
            raise UnsupportedParameter("context", "send the conversation with /api/chat instead")
        if self.images:
            raise UnsupportedParameter("images", "tokenbelt serves text models only")
        if self.raw and self.system:
            raise UnsupportedParameter("system", "a raw prompt is sent as it is, with no system")


class NameRequest(BaseModel):
    """``POST /api/show``, ``DELETE /api/delete``: a model's name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field("", max_length=200)
    #: the name's older spelling, still sent by some clients
    name: str = Field("", max_length=200)
    #: accepted, no effect: the answer always holds all that tokenbelt knows
    verbose: bool = False

    @property
    def which(self) -> str:
        return self.model or self.name


class PullRequest(NameRequest):
    """``POST /api/pull``: fetch and verify a catalog model."""

    stream: bool = True
    #: accepted, no effect: every file is verified against the catalog's sha256 anyway
    insecure: bool = False


class _Embedding(BaseModel):
    """What both embedding routes take beside their inputs: the model, ``keep_alive``,
    empty ``options`` and tokenbelt's own options."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field("", max_length=200)
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = Field(
        None,
        description="num_ctx (the most tokens of an input, up to the model's limit); any other "
        "option only null (unset), as langchain-ollama sends them: embeddings take no "
        "sampling options",
    )
    tokenbelt: TokenbeltOptions | None = None

    def keep_alive_seconds(self) -> float | Literal[False] | None:
        return parse_keep_alive(self.keep_alive)

    def check_supported(self) -> None:
        self.window()
        options = self.options or {}
        given = sorted(k for k, v in options.items() if v is not None and k != "num_ctx")
        if given:
            raise UnsupportedParameter(
                f"options.{given[0]}",
                f"embeddings take no options but num_ctx (got {', '.join(given)})",
            )

    def window(self) -> int | None:
        """``options.num_ctx``: the most tokens of one input (as Ollama's context size
        bounds what it embeds), or None."""
        value = (self.options or {}).get("num_ctx")
        if value is None:
            return None
        return int(check("num_ctx", value, label="options.num_ctx"))


class EmbedRequest(_Embedding):
    """``POST /api/embed``: ``input`` (a string or a list), ``truncate`` (Ollama's default:
    cut inputs longer than the model embeds), ``dimensions``, ``keep_alive``; the
    vectors are unit length, as Ollama's are."""

    input: Any = Field(..., description="a string or a list of strings")
    truncate: bool = True
    dimensions: int | None = None

    def inputs(self) -> list[Any]:
        """The texts to embed: none for ``""`` or ``[]`` (Ollama loads the model and
        answers no embeddings, the way clients preload one)."""
        if self.input in ("", []):
            return []
        return [self.input] if isinstance(self.input, str) else self.input


class LegacyEmbedRequest(_Embedding):
    """``POST /api/embeddings`` (Ollama's first embeddings route): one ``prompt``; its
    vector is not normalised, as Ollama's legacy route gives it."""

    prompt: Any = Field(..., description="one string")
