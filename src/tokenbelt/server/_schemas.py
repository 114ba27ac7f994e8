"""Request bodies of the OpenAI-compatible API, validated with pydantic."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .._defaults import DEFAULT_MAX_TOKENS
from ._tools import CallSpec, ResponseFormat, ToolChoice, ToolSpec

# Long enough for any real use, short enough that a typo is caught.
MAX_TIMEOUT_S = 3600.0


class TokenbeltOptions(BaseModel):
    """tokenbelt's extension object: per-request deadlines and belt capacity."""

    model_config = ConfigDict(extra="forbid")

    first_token_timeout: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="seconds from enqueue to the first token"
    )
    total_timeout: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="seconds from enqueue to the end"
    )
    stall_timeout: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="longest gap between two tokens, seconds"
    )
    capacity: int | None = Field(
        None, ge=1, le=1024, description="how many tokens generation may run ahead of the reader"
    )


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    """A system or user turn."""

    role: Literal["system", "user"]
    content: str


class AssistantMessage(BaseModel):
    """An earlier reply: its text, its calls (sent back with the conversation), or both."""

    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[CallSpec] | None = Field(None, max_length=64)

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(BaseModel):
    """A tool's result, answering the call ``tool_call_id``."""

    role: Literal["tool"]
    content: str
    tool_call_id: str = Field(min_length=1, max_length=256)


Message = Annotated[ChatMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="a loaded model's alias; default: the first")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description=f"longest reply in tokens (default {DEFAULT_MAX_TOKENS})",
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=100_000)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    stop: str | list[str] | None = Field(None, max_length=16)
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    tokenbelt: TokenbeltOptions | None = None

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
        }


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1, max_length=4096)
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="accepted; a reply makes at most one call"
    )

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] = Field(description="one prompt (a list must hold exactly one)")
