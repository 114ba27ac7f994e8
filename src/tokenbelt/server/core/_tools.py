"""Tool calls for the dialects that are not OpenAI's: one plan, one splitter.

Anthropic's ``tools`` and Ollama's ``tools`` translate onto OpenAI-shaped functions and
messages (an assistant turn's ``tool_calls``, a ``tool`` turn with its
``tool_call_id``), then ``runtime.structured`` does the rest as it does for ``/v1``:
the prompt format, the grammar that makes every call parse, and the parsing.

``Calls`` splits a reply, streamed or whole, into text and at most one call with the
same ``structured.CallStream``, so a non-streamed answer and a stream agree: the text
before a call is content, a call's markup never is, and a call cut short (``length``,
a cancel) is not a finished call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._errors import InvalidArgument
from ...engines import GenerationRequest, Grammar, Message, SamplingParams
from ...runtime import Tool, ToolCall, structured
from ._errors import UnsupportedParameter


@dataclass(frozen=True)
class ToolPlan:
    """One request's turns and, when it gives tools, its grammar and its tools."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    #: ``none``, ``auto``, ``required`` or a function's name
    choice: str = "none"
    grammar: Grammar | None = None
    #: the tools as JSON text, for a chat template that renders them itself
    tools_json: str | None = None
    #: the family the calls are written in (``structured.CallFormat``)
    tool_format: str = "tokenbelt"

    @property
    def with_tools(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def request(self, sampling: SamplingParams) -> GenerationRequest:
        return GenerationRequest(
            messages=self.messages, sampling=sampling, grammar=self.grammar, tools=self.tools_json
        )

    def calls(self) -> Calls:
        return Calls(self)

    def grammar_info(self) -> dict[str, Any] | None:
        """For a ``tokenbelt`` object: the grammar's compile time, or None without one."""
        if self.grammar is None:
            return None
        compile_ms = round(self.grammar.compile_s * 1000, 3)
        return {"compile_ms": compile_ms, "cached": self.grammar.cached}

    def extension(self) -> dict[str, Any]:
        """For a ``tokenbelt`` object: the grammar, and the call family when tools are on."""
        out: dict[str, Any] = {}
        if self.grammar is not None:
            out["grammar"] = self.grammar_info()
        if self.with_tools:
            out["tool_format"] = self.tool_format
        return out


def plan_tools(
    messages: Iterable[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    choice: object,
    template_tools: bool,
    tool_format: str = "tokenbelt",
    *,
    tools_field: str = "tools",
    choice_field: str = "tool_choice",
) -> ToolPlan:
    """The plan for OpenAI-shaped ``messages``, ``tools`` and ``choice`` (as
    ``structured.check_choice`` takes it). A tool or choice that cannot be had is an
    ``UnsupportedParameter`` naming the dialect's own field, before any compute. Calls
    are written in ``tool_format``, the model's family."""
    try:
        found = structured.tools_from(tools)
    except InvalidArgument as exc:
        raise UnsupportedParameter(tools_field, str(exc)) from exc
    try:
        chosen = structured.check_choice(choice, found)
    except InvalidArgument as exc:
        raise UnsupportedParameter(choice_field, str(exc)) from exc
    try:
        turns = structured.render_messages(messages, found, chosen, template_tools)
        grammar = structured.tools_grammar(found, chosen, tool_format=tool_format)
    except InvalidArgument as exc:
        raise UnsupportedParameter(tools_field, str(exc)) from exc
    return ToolPlan(
        turns,
        tools=found,
        choice=chosen,
        grammar=grammar,
        tools_json=structured.tools_json(found, chosen, template_tools),
        tool_format=tool_format,
    )


class Calls:
    """A reply split into text and one call, as its pieces come (or all at once).

    ``feed`` and ``finish`` return ``structured.CallStream`` events: ``("content",
    text)``, ``("call", name)``, then ``("arguments", text)`` pieces whose concatenation
    is the arguments' JSON text. After ``finish``, ``call`` is the finished call, or None.
    Without tools every piece is content.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        constrained = plan.choice not in ("auto", "none")
        self._split = structured.CallStream(constrained, plan.tool_format)
        self.call: ToolCall | None = None
        #: the text that is not a call, given out so far
        self.content = ""
        #: the name of a call the reply started (it may not have finished)
        self.started: str | None = None
        #: the arguments' text given out so far (all of it once the call finished)
        self.arguments = ""

    def _seen(self, events: list[tuple[str, str]]) -> list[tuple[str, str]]:
        for kind, text in events:
            if kind == "content":
                self.content += text
            elif kind == "call":
                self.started = text
            else:
                self.arguments += text
        return events

    def feed(self, piece: str) -> list[tuple[str, str]]:
        if not self.plan.with_tools:
            return self._seen([("content", piece)] if piece else [])
        return self._seen(self._split.feed(piece))

    def finish(self) -> list[tuple[str, str]]:
        if not self.plan.with_tools:
            return []
        events, found = self._split.finish(self.plan.tools)
        self.call = found[0] if found else None
        return self._seen(events)

    def whole(self, text: str) -> Calls:
        """Split a whole reply (a non-streamed answer); returns itself."""
        self.feed(text)
        self.finish()
        return self
