"""Responses items, both ways: input items as chat turns, a reply as output items.

The chat machinery (``openai._tools``) takes OpenAI chat messages as plain dicts; input
items become exactly those. An assistant ``message`` and the ``function_call`` items
after it are one assistant turn (its text, then its calls); a ``function_call_output``
is a ``tool`` turn. Items are kept as JSON-ready dicts, the shape ``input_items``
lists and a stored conversation replays.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from ..._errors import InvalidArgument
from ...runtime import structured
from ..core import UnsupportedParameter, file_text
from ._schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    MessageItem,
    ReasoningItem,
)

#: content part types that hold an image or sound (a 400 naming the missing vision)
_MEDIA_PARTS = frozenset({"input_image", "input_audio", "image_url"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text(content: str | list[dict[str, Any]], where: str, model: str) -> str:
    """A string, or text parts joined with newlines (as the chat route joins them)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        here = f"{where}.{j}"
        if kind in _MEDIA_PARTS:
            raise UnsupportedParameter(
                here, f"{model} has no vision: it reads text only, so it cannot see {kind}"
            )
        if kind == "input_file":
            fields = {k: v for k, v in part.items() if k != "type"}
            texts.append(file_text(fields, here, model))
            continue
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise UnsupportedParameter(
                here, f"content parts of type {kind!r}; {model} reads text parts only"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def items_from(given: str | Sequence[Item]) -> list[dict[str, Any]]:
    """The request's ``input`` as stored items (each with an id), checked for type."""
    if isinstance(given, str):
        given = [MessageItem(role="user", content=given, id=None)]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        known = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
        if not isinstance(item, known):
            raise UnsupportedParameter(
                f"input.{i}.type",
                f"input items of type {item.type!r}: tokenbelt reads message, function_call, "
                "function_call_output and reasoning items",
            )
        entry = _dump(item)
        if entry.get("id") is None:
            prefix = {
                "message": "msg",
                "function_call": "fc",
                "function_call_output": "fco",
                "reasoning": "rs",
            }
            entry["id"] = new_id(prefix[entry["type"]])
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            part = "output_text" if item.role == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": item.content}]
        out.append(entry)
    return out


def match_outputs(items: Sequence[dict[str, Any]], first: int = 0) -> None:
    """Give each ``function_call_output`` without a ``call_id`` the id of the call it
    answers, as Codex means it: the latest unanswered ``function_call`` of its ``name``
    (and its ``namespace``, when both name one) before it. ``first``: the index of the
    request's own first item (earlier ones come from a stored conversation); an output
    that answers no call is refused by its index among the request's items."""
    open_calls: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            open_calls.append(item)
        elif item["type"] == "function_call_output":
            call_id = item.get("call_id")
            if call_id is None:
                call_id = _answered(item, open_calls, f"input.{i - first}")
                item["call_id"] = call_id
            open_calls = [c for c in open_calls if c["call_id"] != call_id]


def _answered(output: dict[str, Any], open_calls: list[dict[str, Any]], where: str) -> str:
    name, namespace = output.get("name"), output.get("namespace")
    if name is None:
        raise UnsupportedParameter(
            f"{where}.call_id",
            "a function_call_output names the call it answers by call_id (or, as Codex "
            "sends it, by the function's name)",
        )
    for call in reversed(open_calls):
        space = call.get("namespace")
        if call["name"] == name and (namespace is None or space is None or space == namespace):
            return str(call["call_id"])
    called = f"{namespace}.{name}" if namespace else name
    raise InvalidArgument(
        f"{where}: a function_call_output without call_id answers the latest unanswered "
        f"function_call of its name ({called!r}) before it, and there is none",
        param=f"{where}.name",
    )


def _dump(item: BaseModel) -> dict[str, Any]:
    return item.model_dump(exclude_none=True, by_alias=True)


def messages_from(items: Sequence[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """Items as the chat messages the tool planner takes."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            continue  # an earlier turn's thinking: not shown to the model again
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            text = _text(item["content"], f"input.{i}.content", model)
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            text = _text(item["output"], f"input.{i}.output", model)
            out.append({"role": "tool", "content": text, "tool_call_id": item["call_id"]})
    orphan = structured.unanswered(out, anywhere=True)
    if orphan is not None:
        raise InvalidArgument(
            f"input: no function_call before the function_call_output for call_id "
            f"{orphan[1]!r}; an output answers a call made earlier in the conversation",
            param="input",
        )
    return out


def text_part(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = text_part(text)
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part] if text or status != "in_progress" else [],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A thinking model's reasoning: its own text whole (``reasoning_text``), no summary."""
    content = [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str, namespace: str | None
) -> dict[str, Any]:
    """A ``function_call``; a function offered from a ``namespace`` tool names it."""
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item
