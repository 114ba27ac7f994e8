"""The request bodies of Anthropic's Messages API, and its error shape.

``MessagesRequest`` translates a body onto the OpenAI-shaped messages and tools the tool
planner takes (``core.plan_tools``): a ``tool_use`` block is an assistant turn's call, a
``tool_result`` block a ``tool`` turn with its ``tool_call_id``. Only ``custom`` tools
(name, description, ``input_schema``) can be had: Anthropic's server tools (web search,
bash, the text editor, code execution...) run on Anthropic's side, and are refused by
their type. Unknown fields are refused by name. Three fields that ask nothing of the
model are accepted and have no effect: ``metadata`` (a caller's own labels),
``service_tier`` (``auto`` or ``standard_only``: there is one tier here) and
``cache_control``, on the request, a block or a tool (a prompt-caching hint); a tool's
``eager_input_streaming`` and ``strict`` are accepted as what every call here does
(its input streamed as it is made, and held to ``input_schema``); so are
``thinking``, ``context_management`` and ``output_config`` where their value asks for
nothing this server would do otherwise (``_options``).

A ``system`` message inside ``messages`` (Anthropic's mid-conversation system message,
which Claude Code sends after the first user turn) is system text: Anthropic applies it
as a system instruction where it sits. Chat templates take one system prompt, first (many
refuse a system turn anywhere else), so each one joins the ``system`` text, in order, a
blank line between them.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..._errors import InvalidArgument
from ...runtime import structured
from ..core import TokenbeltOptions, UnsupportedParameter, file_text, ranges
from ._options import ContextManagement, OutputConfig, Thinking

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


#: the numbers in an engine's "prompt does not fit" message (``PromptTooLong``)
_TOO_LONG = re.compile(r"the prompt has (\d+) tokens but .*? holds (\d+)")


def error_shape(
    status: int, message: str, type_: str, code: str | None, param: str | None
) -> tuple[int, dict[str, Any]]:
    """``{"type": "error", "error": {"type", "message"}}``; a malformed body is a 400.

    A prompt too long for the context starts as Anthropic's does ("prompt is too long:
    N tokens > M maximum"), the words clients such as Claude Code look for before they
    compact a conversation; tokenbelt's own account follows."""
    status = 400 if status == 422 else status
    found = _TOO_LONG.search(message) if code == "context_length_exceeded" else None
    if found is not None:
        tokens, holds = (int(n) for n in found.groups())
        # One generated token must fit too: the most a prompt may have is one less.
        message = f"prompt is too long: {tokens} tokens > {holds - 1} maximum ({message})"
    return status, {"type": "error", "error": {"type": error_type(status), "message": message}}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


#: the keys of each block type this route reads (``cache_control`` has no effect)
_KEYS = {
    "text": {"type", "text", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature", "cache_control"},
    "document": {"type", "source", "title", "context", "citations", "cache_control"},
}
#: which role may send each block type (an earlier turn's ``thinking`` is taken and left
#: out of the prompt, as thinking models' templates drop it)
_ROLE = {
    "text": ("user", "assistant"),
    "tool_use": ("assistant",),
    "tool_result": ("user",),
    "thinking": ("assistant",),
    "document": ("user",),
}
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}
#: a tool's flags that ask for what every call here does anyway: its input is streamed
#: as it is made (``eager_input_streaming``, which the AI SDK's Anthropic provider sets on
#: every streamed tool) and matches ``input_schema`` (``strict``: the grammar makes it)
_TOOL_FLAGS = {"eager_input_streaming", "strict"}


def _get(block: dict[str, Any], key: str, kind: type, where: str, required: bool = True) -> Any:
    """``block[key]`` if it is a ``kind``; a missing or mistyped field is refused by name."""
    if key not in block and not required:
        return None
    value = block.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        what = {str: "a string", dict: "an object", bool: "a boolean"}.get(kind, kind.__name__)
        raise UnsupportedParameter(f"{where}.{key}", f"it must be {what}")
    return value


def _check_block(block: object, where: str, role: str | None) -> str:
    """The type of a content block, refused by name unless this route can read it."""
    if not isinstance(block, dict):
        raise UnsupportedParameter(where, "a content block is an object")
    kind = block.get("type")
    if kind not in _KEYS or (role is None and kind != "text"):
        can = (
            "text"
            if role is None
            else "text, tool_use and thinking (assistant), tool_result and document (user)"
        )
        raise UnsupportedParameter(f"{where}.type", f"content blocks of type {kind!r}; only {can}")
    if role is not None and role not in _ROLE[kind]:
        raise UnsupportedParameter(
            f"{where}.type", f"a {kind} block comes in a {_ROLE[kind][0]} turn, not a {role} one"
        )
    extra = set(block) - _KEYS[kind]
    if extra:
        raise UnsupportedParameter(f"{where}.{sorted(extra)[0]}")
    return str(kind)


def _text(content: str | list[Any], where: str) -> str:
    """Text-only content (a tool result's): any block but text is refused by name."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        _check_block(block, f"{where}[{j}]", None)
        parts.append(_get(block, "text", str, f"{where}[{j}]"))
    return "".join(parts)


def _document(block: dict[str, Any], where: str) -> str:
    """A ``document`` block of text (a ``text`` source, or ``base64`` of a text media
    type) as its title, its context and its text; a PDF, a URL or citations are refused
    by name (``core.file_text`` reads the bytes)."""
    citations = _get(block, "citations", dict, where, required=False)
    if citations and citations.get("enabled"):
        raise UnsupportedParameter(f"{where}.citations", "tokenbelt cites no sources")
    source = _get(block, "source", dict, where)
    kind = source.get("type")
    title = _get(block, "title", str, where, required=False) or ""
    if kind == "text":
        data = _get(source, "data", str, f"{where}.source")
    elif kind == "base64":
        media = _get(source, "media_type", str, f"{where}.source")
        encoded = _get(source, "data", str, f"{where}.source")
        fields = {"file_data": f"data:{media};base64,{encoded}"}
        data = file_text(fields, f"{where}.source", "this model")
    else:
        raise UnsupportedParameter(
            f"{where}.source.type",
            f"documents of source type {kind!r}; tokenbelt reads text and base64 text "
            "sources (it fetches no URL and has no Files API)",
        )
    context = _get(block, "context", str, where, required=False) or ""
    return "\n".join(part for part in (title, context, data) if part)


def _turns(role: str, content: str | list[Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI-shaped turns: an assistant turn with its
    ``tool_calls``, or user text and one ``tool`` turn per ``tool_result``."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _check_block(block, at, role)
        if kind == "text":
            text.append(_get(block, "text", str, at))
        elif kind == "thinking":
            _get(block, "thinking", str, at)
        elif kind == "document":
            text.append(_document(block, at) + "\n\n")  # before what follows it
        elif kind == "tool_use":
            args = json.dumps(_get(block, "input", dict, at), ensure_ascii=False)
            function = {"name": _get(block, "name", str, at), "arguments": args}
            call_id = _get(block, "id", str, at)
            calls.append({"id": call_id, "type": "function", "function": function})
        else:
            if text:  # text before a result keeps its place
                out.append({"role": role, "content": "".join(text)})
                text = []
            raw = block.get("content", "")
            if not isinstance(raw, str | list):
                raise UnsupportedParameter(f"{at}.content", "it is a string or a list of blocks")
            result = _text(raw, f"{at}.content")
            if _get(block, "is_error", bool, at, required=False):
                result = f"Error: {result}"
            call_id = _get(block, "tool_use_id", str, at)
            out.append({"role": "tool", "content": result, "tool_call_id": call_id})
    if role == "assistant":
        turn: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    if text or not out:
        out.append({"role": role, "content": "".join(text)})
    return out


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant", "system"]
    content: str | list[Any]


class ToolChoice(BaseModel):
    """``tool_choice``: ``auto``, ``any``, ``tool`` (with a ``name``) or ``none``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = Field(
        None, description="accepted: a reply makes one call at most either way"
    )

    def openai(self) -> str | dict[str, Any]:
        """The choice as OpenAI's ``tool_choice``."""
        if self.type == "tool":
            if self.name is None:
                raise UnsupportedParameter("tool_choice.name", "a choice of type tool names it")
            return {"type": "function", "function": {"name": self.name}}
        if self.name is not None:
            raise UnsupportedParameter("tool_choice.name", "only a choice of type tool names one")
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt of a request, without its sampling."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(max_length=200, description="a loaded model's name")
    messages: list[InputMessage] = Field(min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[Any] | None = Field(None, max_length=1024)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None

    def thinking_sampling(self) -> dict[str, object]:
        """``think`` and ``reasoning_budget`` of ``thinking`` (nothing without it)."""
        return self.thinking.sampling() if self.thinking is not None else {}

    def check(self) -> None:
        """Refuse by name the option values that ask for what this server does not do."""
        for option in (self.thinking, self.context_management, self.output_config):
            if option is not None:
                option.check()

    def turns(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI-shaped messages, the system prompt first (with the
        ``system`` messages' text after it, in order)."""
        system: list[str] = []
        if isinstance(self.system, str) and self.system:
            system.append(self.system)
        elif isinstance(self.system, list) and self.system:
            system.append("".join(b.text for b in self.system))
        out: list[dict[str, Any]] = []
        last: int | None = None
        for i, m in enumerate(self.messages):
            if m.role == "system":
                text = _text(m.content, f"messages[{i}].content")
                if text:
                    system.append(text)
                continue
            last = i
            turns = _turns(m.role, m.content, f"messages[{i}]")
            before = out[-1:] if out and out[-1]["role"] == "assistant" else []
            orphan = structured.unanswered([*before, *turns])
            if orphan is not None:
                raise InvalidArgument(
                    f"messages[{i}]: tool_result for tool_use_id {orphan[1]!r}, which no "
                    "tool_use block of the previous message has; each tool_result answers a "
                    "tool_use of the assistant message before it",
                    param=f"messages[{i}].content",
                )
            out.extend(turns)
        if last is None:
            raise UnsupportedParameter("messages", "system messages alone; send a user turn")
        if self.messages[last].role == "assistant" and not self.continues_final():
            # Anthropic continues a final assistant turn (prefill): its text, not a call.
            raise UnsupportedParameter(
                f"messages[{last}]",
                "a final assistant turn to continue (prefill) is text: no tool_use blocks, "
                "not empty",
            )
        if system:
            out.insert(0, {"role": "system", "content": "\n\n".join(system)})
        return out

    def continues_final(self) -> bool:
        """The conversation ends with an assistant turn of text that the reply continues
        (Anthropic's prefill)."""
        final = [m for m in self.messages if m.role != "system"][-1:]
        if not final or final[0].role != "assistant":
            return False
        content = final[0].content
        if isinstance(content, str):
            return bool(content.strip())
        texts = [b for b in content if isinstance(b, dict) and b.get("type") == "text"]
        return len(texts) == len(content) and any(str(b.get("text", "")).strip() for b in texts)

    def openai_tools(self) -> list[dict[str, Any]]:
        """``tools`` as OpenAI-shaped functions; only custom tools, the others by type."""
        out = []
        for i, tool in enumerate(self.tools or ()):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise UnsupportedParameter(where, "a tool is an object")
            kind = tool.get("type", "custom")
            if kind not in (None, "custom"):
                raise UnsupportedParameter(
                    f"{where}.type",
                    f"{kind!r} is one of Anthropic's server tools, run on Anthropic's side; "
                    "this route takes custom tools (name, description, input_schema)",
                )
            extra = set(tool) - _TOOL_KEYS - _TOOL_FLAGS
            if extra:
                raise UnsupportedParameter(f"{where}.{sorted(extra)[0]}")
            for flag in sorted(_TOOL_FLAGS & set(tool)):
                _get(tool, flag, bool, where)
            function = {
                "name": _get(tool, "name", str, where),
                "parameters": _get(tool, "input_schema", dict, where),
            }
            description = _get(tool, "description", str, where, required=False)
            if description:
                function["description"] = description
            out.append({"type": "function", "function": function})
        return out

    def openai_choice(self) -> str | dict[str, Any] | None:
        """``tool_choice`` as OpenAI's; ``auto`` or ``none`` with no tools is no choice."""
        choice = self.tool_choice.openai() if self.tool_choice is not None else None
        return None if not self.tools and choice in ("auto", "none") else choice


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = ranges.bounded("max_tokens", ..., "required, as Anthropic requires it")
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: ranges.TopK = None
    metadata: dict[str, Any] | None = Field(None, description="accepted; has no effect")
    cache_control: dict[str, Any] | None = Field(None, description="accepted; has no effect")
    service_tier: Literal["auto", "standard_only"] | None = Field(
        None, description="accepted; one tier here, so either value asks the same"
    )
    tokenbelt: TokenbeltOptions | None = None

    def sampling(self) -> dict[str, object]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            **self.thinking_sampling(),
        }
