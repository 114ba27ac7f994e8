"""Request bodies of the OpenAI-compatible API, validated with pydantic."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..._defaults import DEFAULT_MAX_TOKENS
from ...belt import RANGES
from ..core import TokenbeltOptions, ranges
from ._tools import CallSpec, ResponseFormat, ToolChoice, ToolSpec


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    include_obfuscation: bool | None = Field(
        None, description="accepted, no effect: a local stream is not padded"
    )
    continuous_usage_stats: bool = Field(
        False, description="usage (tokens so far) on every chunk, as vLLM sends it"
    )


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts can be answered here."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A system, developer (read as system) or user turn."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user"]
    content: str | list[ContentPart] = Field(description="a string or a list of text parts")
    name: str | None = Field(None, max_length=256, description="the speaker's name")


#: OpenAI request fields that mean nothing to a local server: accepted, with no effect
IGNORED_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)
#: most choices one request may ask for (``n``): each is a sequence of its own
MAX_CHOICES = int(RANGES["n"].high)


class AssistantMessage(BaseModel):
    """An earlier reply: its text, its calls (sent back with the conversation), or both."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["assistant"]
    content: str | list[ContentPart] | None = Field(
        None, description="a string or a list of text parts; null when it made tool calls"
    )
    name: str | None = Field(None, max_length=256, description="the speaker's name")
    tool_calls: list[CallSpec] | None = Field(None, max_length=64)
    refusal: str | None = Field(None, description="accepted, no effect")

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(BaseModel):
    """A tool's result, answering the call ``tool_call_id``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["tool"]
    content: str | list[ContentPart] = Field(description="a string or a list of text parts")
    tool_call_id: str = Field(min_length=1, max_length=256)
    name: str | None = Field(None, max_length=256, description="the tool's name")


Message = Annotated[ChatMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class _Sampling(BaseModel):
    # Anything not declared here is a 400 naming it: a parameter is never silently ignored.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="a loaded model's alias; default: the first")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = ranges.bounded(
        "max_tokens", description=f"longest reply in tokens (default {DEFAULT_MAX_TOKENS})"
    )
    max_completion_tokens: int | None = ranges.bounded("max_tokens")
    temperature: ranges.Temperature = None
    top_p: ranges.TopP = None
    top_k: ranges.TopK = None
    min_p: ranges.MinP = None
    repeat_penalty: ranges.RepeatPenalty = None
    seed: ranges.Seed = None
    stop: ranges.Stop = None
    n: int = ranges.bounded("n", 1, description="choices to generate, each a sequence of its own")
    frequency_penalty: ranges.Penalty = None
    presence_penalty: ranges.Penalty = None
    logit_bias: dict[str, float] | None = Field(
        None, max_length=1024, description="token id -> bias in [-100, 100]"
    )
    # What vLLM- and llama.cpp-oriented clients (benchmarks among them) send.
    ignore_eos: bool = Field(False, description="never end on an end token: run to max_tokens")
    min_tokens: int = ranges.bounded(
        "min_tokens", 0, description="end tokens are banned until this many were generated"
    )
    return_token_ids: bool = Field(
        False, description="the prompt's and the reply's token ids, as vLLM returns them"
    )
    return_progress: bool = Field(
        False,
        description="stream only: until the first token, a chunk with no choices and "
        "llama.cpp's prompt_progress (total, cache, processed, time_ms) whenever more of "
        "the prompt has been read",
    )
    cache_prompt: bool = Field(
        True,
        description="false: compute the whole prompt, reusing no cached prefix (true, the "
        "default: the prefix cache is always on)",
    )
    tokenbelt: TokenbeltOptions | None = None
    # accepted without effect: see IGNORED_FIELDS
    user: str | None = Field(None, description="accepted, no effect")
    store: bool | None = Field(None, description="accepted, no effect")
    metadata: dict[str, str] | None = Field(None, description="accepted, no effect")
    service_tier: str | None = Field(None, description="accepted, no effect")
    prompt_cache_key: str | None = Field(None, description="accepted, no effect")
    safety_identifier: str | None = Field(None, description="accepted, no effect")

    def sampling(self) -> dict[str, object]:
        """The sampling keyword arguments the runtime takes (None = its default).

        ``max_tokens`` is always given: the surfaces' shared default when the body has none.
        """
        stop = self.stop
        return {
            "max_tokens": self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "seed": self.seed,
            "stop": [stop] if isinstance(stop, str) else stop,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "logit_bias": self.logit_bias,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "return_token_ids": self.return_token_ids,
        }


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1, max_length=4096)
    logprobs: bool = Field(False, description="each output token's log-probability")
    top_logprobs: int | None = ranges.bounded(
        "top_logprobs", description="with logprobs: the likeliest tokens of each step"
    )
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="accepted; a reply makes at most one call"
    )
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = Field(
        None,
        description="a thinking model: none answers at once; low, medium and high go to "
        "a chat template that reads an effort level (else a 400)",
    )
    modalities: list[Literal["text"]] | None = Field(
        None, max_length=1, description='["text"]: what every reply is (audio is a 400)'
    )

    def sampling(self) -> dict[str, object]:
        effort = self.reasoning_effort
        return {
            **super().sampling(),
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "think": None if effort is None else (False if effort == "none" else effort),
        }


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="one prompt: text or token ids (a list of prompts must hold exactly one)"
    )
    logprobs: int | None = Field(
        None, ge=0, le=5, description="log-probabilities of each token and its N likeliest"
    )
    echo: bool = Field(False, description="put the prompt before the completion")
    suffix: str | None = Field(
        None,
        description="fill in the middle: the text after the completion (the prompt is the "
        "text before it), for a model whose vocabulary has FIM tokens",
    )

    def sampling(self) -> dict[str, object]:
        return {
            **super().sampling(),
            "logprobs": self.logprobs is not None,
            "top_logprobs": self.logprobs,
        }
