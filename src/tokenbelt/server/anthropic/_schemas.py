"""The request body of Anthropic's Messages API, and its error shape.

Unknown fields (``tools``, ``thinking``...) are refused by name. Two fields that ask
nothing of the model are accepted and have no effect: ``metadata`` (a caller's own
labels) and ``cache_control``, on the request or on a text block (a prompt-caching hint).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engines import Message
from ..core import TokenbeltOptions, UnsupportedParameter

#: HTTP status -> Anthropic's error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_shape(
    status: int, message: str, type_: str, code: str | None, param: str | None
) -> tuple[int, dict[str, Any]]:
    """``{"type": "error", "error": {"type", "message"}}``; a malformed body is a 400."""
    status = 400 if status == 422 else status
    return status, {"type": "error", "error": {"type": error_type(status), "message": message}}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a message's content; any block but text is refused by name."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind != "text":
            raise UnsupportedParameter(
                f"{where}.content[{j}].type", f"content blocks of type {kind!r}; only text"
            )
        extra = set(block) - {"type", "text", "cache_control"}
        if extra:
            raise UnsupportedParameter(f"{where}.content[{j}].{sorted(extra)[0]}")
        text = block.get("text")
        if not isinstance(text, str):
            raise UnsupportedParameter(f"{where}.content[{j}].text", "it must be a string")
        parts.append(text)
    return "".join(parts)


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """``POST /v1/messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=200, description="a loaded model's name")
    messages: list[InputMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int = Field(ge=1, le=1_000_000, description="required, as Anthropic requires it")
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=100_000)
    metadata: dict[str, Any] | None = Field(None, description="accepted; has no effect")
    cache_control: dict[str, Any] | None = Field(None, description="accepted; has no effect")
    tokenbelt: TokenbeltOptions | None = None

    def chat(self) -> tuple[Message, ...]:
        """The conversation as tokenbelt messages, the system prompt first."""
        out: list[Message] = []
        if isinstance(self.system, str) and self.system:
            out.append({"role": "system", "content": self.system})
        elif isinstance(self.system, list) and self.system:
            out.append({"role": "system", "content": "".join(b.text for b in self.system)})
        for i, m in enumerate(self.messages):
            out.append({"role": m.role, "content": _text(m.content, f"messages[{i}]")})
        if self.messages[-1].role == "assistant":
            # Anthropic continues a final assistant turn; tokenbelt's chat template would
            # start a new one instead, so say so rather than answer something else.
            raise UnsupportedParameter(
                f"messages[{len(self.messages) - 1}]",
                "a final assistant turn to continue (prefill); end with a user turn",
            )
        return tuple(out)

    def sampling(self) -> dict[str, object]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
        }
