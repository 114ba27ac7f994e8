"""``response_format``, ``tools`` and ``tool_choice`` on chat completions.

Structured output and tool calls are enforced by a grammar during sampling
(``runtime/_structured.py`` has the prompt format and the parsing); what a grammar
cannot enforce exactly is validated once the reply is complete, and the response's
``tokenbelt.schema`` says whether it validated. With both ``response_format`` and
``tools`` under ``auto`` the reply is a call or the format's JSON; ``required`` or a
named function make it a call, ``none`` the JSON.

When a reply ends early (``length``, a stop string, a cancel or a deadline), its text
is returned as it is, with the finish reason of that end: a JSON reply may then be cut
short. A call cut short is in ``tool_calls`` with the arguments written so far, streamed
or not, and ``tokenbelt.tool_call_cut`` is true; its markup never reaches ``content``.

Calls are written in the model's own family's format (``Model.tool_format``: ``hermes``,
``llama3``, ``mistral``, or tokenbelt's ``<tool_call>`` fallback), and
``tokenbelt.tool_format`` says which.
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
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    name: str = Field(pattern=_NAME.pattern)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="always enforced: the grammar is strict")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=_NAME.pattern)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="always enforced: the grammar is strict")


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

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
    #: the schema a reply that calls nothing must match (``response_format``)
    schema: dict[str, Any] | None = None
    #: a call was cut short (its arguments are the part written)
    cut: bool = False
    #: the reply checked against its schema (``tokenbelt.schema``)
    check: structured.SchemaCheck | None = None
    #: the family the calls are written in (``tokenbelt.tool_format``)
    tool_format: str = "tokenbelt"

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

    def extension(self) -> dict[str, Any]:
        """What the reply adds to ``tokenbelt``: its grammar, its schema check, a cut call."""
        out: dict[str, Any] = {}
        if self.grammar is not None:
            out["grammar"] = self.info()
        if self.check is not None:
            out["schema"] = self.check.to_dict()
        if self.with_tools:
            out["tool_call_cut"] = self.cut
            out["tool_format"] = self.tool_format
        return out

    def validate(self, content: str, ended_early: bool) -> None:
        """Check the finished reply: a call's arguments against its tool's parameters,
        else the content against the schema."""
        if self.calls:
            call = self.calls[0]
            params = next(t.parameters for t in self.tools if t.name == call.name)
            self.check = structured.check_reply(params, call.arguments, cut=self.cut)
        elif self.schema is not None:
            self.check = structured.check_reply(self.schema, content, cut=ended_early)


def plan(
    messages: list[dict[str, Any]],
    response_format: ResponseFormat | None,
    tools: list[ToolSpec] | None,
    tool_choice: ToolChoice | None,
    template_tools: bool = False,
    tool_format: str = "tokenbelt",
) -> Plan:
    """Turns, grammar and tools for a request; ``UnsupportedParameter`` (400) if the
    schema cannot be compiled, before any compute. ``template_tools``: the model's chat
    template renders tools itself, so they go to it rather than into the system text;
    ``tool_format``: the call family the grammar and the parsing use."""
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
    answer: dict[str, Any] | None = None
    if fmt == "json_object":
        answer = {"type": "object"}
    elif fmt == "json_schema":
        spec = response_format.json_schema if response_format else None
        if spec is None:
            raise UnsupportedParameter("response_format", 'json_schema needs "json_schema"')
        answer = spec.schema_ if spec.schema_ is not None else {"type": "object"}
    calls_only = bool(found) and choice not in ("none", "auto")
    result = Plan(
        structured.render_messages(
            messages, found, choice, template_tools, json_answer=answer is not None
        ),
        tools=found,
        choice=choice,
        tools_json=structured.tools_json(found, choice, template_tools),
        schema=None if calls_only else answer,
        tool_format=tool_format,
    )
    try:
        if found and choice != "none":
            result.grammar = structured.tools_grammar(found, choice, answer, tool_format)
        elif fmt == "json_object":
            result.grammar = json_object_grammar()
        elif answer is not None:
            result.grammar = schema_grammar(answer)
    except InvalidArgument as exc:
        # a message names where it failed: "function f" or "response_format" or the top
        param = "tools" if "function" in str(exc) or fmt == "text" else "response_format"
        raise UnsupportedParameter(param, str(exc)) from exc
    return result


def message(text: str, p: Plan, ended_early: bool) -> dict[str, Any]:
    """The ``message`` of a non-streamed answer, the same as the streamed deltas add up
    to (a cut call too); fills ``p.calls``, ``p.cut`` and ``p.check``."""
    deltas = Deltas(p)
    content: list[str] = []
    call: dict[str, Any] | None = None
    for delta in [*deltas.feed(text), *deltas.finish(ended_early)]:
        if "content" in delta:
            content.append(delta["content"])
        for piece in delta.get("tool_calls", ()):
            if call is None:
                call = {k: v for k, v in piece.items() if k != "index"}
                call["function"] = dict(piece["function"])
            else:
                call["function"]["arguments"] += piece["function"]["arguments"]
    if call is None:
        return {"role": "assistant", "content": "".join(content)}
    return {"role": "assistant", "content": "".join(content) or None, "tool_calls": [call]}


class Deltas:
    """Turns streamed text into ``delta`` objects (``content`` or ``tool_calls``)."""

    def __init__(self, p: Plan) -> None:
        self.plan = p
        constrained = p.choice not in ("auto", "none")
        self._calls = structured.CallStream(constrained, p.tool_format)
        self._id = self._calls.format.new_id()
        self._text: list[str] = []

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
            self._text.append(piece)
            return [{"content": piece}]
        return self._shape(self._calls.feed(piece))

    def finish(self, ended_early: bool) -> list[dict[str, Any]]:
        """The last deltas; ``plan.calls`` holds the call if the reply made one (cut
        short when ``ended_early`` cut it: ``plan.cut``), ``plan.check`` its check."""
        p = self.plan
        if not p.with_tools:
            p.validate("".join(self._text), ended_early)
            return []
        events, calls = self._calls.finish(p.tools, cut=ended_early)
        p.calls = [ToolCall(self._id, c.name, c.arguments) for c in calls]
        p.cut = self._calls.cut
        p.validate(self._calls.content, ended_early)
        return self._shape(events)
