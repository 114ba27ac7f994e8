"""``response_format``, ``tools`` and ``tool_choice`` on chat completions.

Structured output and tool calls are enforced by a grammar during sampling
(``runtime/_structured.py`` has the prompt format and the parsing). When a reply ends
early (``length``, a stop string, a cancel or a deadline), its text is returned as it
is, with the finish reason of that end: a JSON reply may then be cut short, and a call
that did not complete is not in ``tool_calls`` (a stream may already have sent part of
its arguments).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..._errors import InvalidArgument
from ...engines import Grammar, Message, json_object_grammar, schema_grammar
from ...runtime import Tool, ToolCall, structured
from ..core import UnsupportedParameter

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=_NAME.pattern)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="always enforced: the grammar is strict")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_NAME.pattern)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="always enforced: the grammar is strict")


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class CallFunction(BaseModel):
    name: str
    arguments: str


class CallSpec(BaseModel):
    """A call in an assistant message the client sends back."""

    id: str
    type: Literal["function"] = "function"
    function: CallFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class Plan:
    """How one chat request is shaped: its turns, its grammar, its tools."""

    messages: tuple[Message, ...]
    grammar: Grammar | None = None
    tools: tuple[Tool, ...] = ()
    choice: str = "none"
    calls: list[ToolCall] = field(default_factory=list)
    #: the request's ``tools`` for a chat template that renders them (JSON text)
    tools_json: str | None = None

    @property
    def with_tools(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def info(self) -> dict[str, Any] | None:
        """For the response's ``tokenbelt`` object: the grammar's compile time."""
        if self.grammar is None:
            return None
        return {
            "compile_ms": round(self.grammar.compile_s * 1000, 3),
            "cached": self.grammar.cached,
        }


def plan(
    messages: list[dict[str, Any]],
    response_format: ResponseFormat | None,
    tools: list[ToolSpec] | None,
    tool_choice: ToolChoice | None,
    template_tools: bool = False,
) -> Plan:
    """Turns, grammar and tools for a request; ``UnsupportedParameter`` (400) if the
    schema cannot be compiled, before any compute. ``template_tools``: the model's chat
    template renders tools itself, so they go to it rather than into the system text."""
    try:
        found = structured.tools_from(t.model_dump(exclude_none=True) for t in tools or ())
    except InvalidArgument as exc:
        raise UnsupportedParameter("tools", str(exc)) from exc
    choice_value = tool_choice.model_dump() if isinstance(tool_choice, BaseModel) else tool_choice
    try:
        choice = structured.check_choice(choice_value, found)
    except InvalidArgument as exc:
        raise UnsupportedParameter("tool_choice", str(exc)) from exc
    fmt = response_format.type if response_format is not None else "text"
    if fmt != "text" and found and choice != "none":
        raise UnsupportedParameter(
            "response_format", "use either a JSON response_format or tools, not both"
        )
    result = Plan(
        structured.render_messages(messages, found, choice, template_tools),
        tools=found,
        choice=choice,
        tools_json=structured.tools_json(found, choice, template_tools),
    )
    try:
        if fmt == "json_object":
            result.grammar = json_object_grammar()
        elif fmt == "json_schema":
            spec = response_format.json_schema if response_format else None
            if spec is None:
                raise InvalidArgument('response_format json_schema needs "json_schema"')
            schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
            result.grammar = schema_grammar(schema)
        else:
            result.grammar = structured.tools_grammar(found, choice)
    except InvalidArgument as exc:
        raise UnsupportedParameter(
            "tools" if fmt == "text" else "response_format", str(exc)
        ) from exc
    return result


def message(text: str, p: Plan) -> dict[str, Any]:
    """The ``message`` of a non-streamed answer; fills ``p.calls``."""
    if not p.with_tools:
        return {"role": "assistant", "content": text}
    content, p.calls = structured.parse_tool_calls(text, p.tools)
    if not p.calls:
        return {"role": "assistant", "content": text}
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [c.to_openai() for c in p.calls],
    }


class Deltas:
    """Turns streamed text into ``delta`` objects (``content`` or ``tool_calls``)."""

    def __init__(self, p: Plan) -> None:
        self.plan = p
        self._calls = structured.CallStream(constrained=p.choice not in ("auto", "none"))
        self._id = structured.new_call_id()

    def _shape(self, events: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in events:
            if kind == "content":
                out.append({"content": text})
            elif kind == "call":
                fn = {"name": text, "arguments": ""}
                call = {"index": 0, "id": self._id, "type": "function", "function": fn}
                out.append({"tool_calls": [call]})
            else:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if not self.plan.with_tools:
            return [{"content": piece}]
        return self._shape(self._calls.feed(piece))

    def finish(self) -> list[dict[str, Any]]:
        """The last deltas; ``plan.calls`` holds the call if one completed."""
        if not self.plan.with_tools:
            return []
        events, calls = self._calls.finish(self.plan.tools)
        self.plan.calls = [ToolCall(self._id, c.name, c.arguments) for c in calls]
        return self._shape(events)
