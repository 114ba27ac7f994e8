"""Structured output and tool calls: the prompt format, the grammars and the parsing.

A model whose chat template renders tools itself (``Model.template_tools``) gets them
through it (``render_messages(..., template_tools=True)`` and ``tools_json``). Otherwise,
as for the embedded model, whose template has no tool format of its own, tool calls use
one documented prompt format (the one Hermes and Qwen models are trained on):

- the tools are described in the system message, inside ``<tools></tools>``, one
  OpenAI-shaped function per line;
- a call is ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``; a grammar makes
  every call parse and its arguments match the function's JSON schema;
- an assistant turn that called tools is rendered as its text followed by its calls, and
  a tool's result as a user turn ``<tool_response>...</tool_response>``.

Either way a call is the ``<tool_call>`` JSON above, which the grammar enforces.

``tool_choice``: ``none`` describes no tools and constrains nothing; ``required`` and a
named function constrain the whole reply to one call; ``auto`` leaves the text free
until the reply starts a call (a lazy grammar triggered by ``<tool_call>``), and from
there the call is constrained. One call per reply.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidArgument
from ..engines import (
    CALL_ARGUMENTS,
    CALL_PREFIX,
    Grammar,
    Message,
    functions_grammar,
    schema_grammar,
)
from ._validation import SchemaCheck as SchemaCheck  # reached as ``structured.SchemaCheck``
from ._validation import check_reply as check_reply

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(TOOL_OPEN) + r"\s*(\{.*\})\s*" + re.escape(TOOL_CLOSE), re.DOTALL)
#: what may follow the arguments' last character: closing braces, spaces, the closing tag
_HELD = re.compile(
    r"(?:\}\s*)+(?:<(?:/(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l>?)?)?)?)?)?)?)?)?)?)?)?$"
)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and JSON schema."""

    name: str
    parameters: Mapping[str, Any]
    description: str = ""

    @classmethod
    def from_openai(cls, spec: object) -> Tool:
        """From ``{"type": "function", "function": {...}}`` (or the inner object)."""
        if isinstance(spec, Tool):
            return spec
        if not isinstance(spec, Mapping):
            raise InvalidArgument(f"a tool is an object, got {type(spec).__name__}")
        if spec.get("type", "function") != "function":
            raise InvalidArgument(f"only function tools are supported, got {spec.get('type')!r}")
        fn = spec.get("function", spec)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidArgument("a function tool needs a name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise InvalidArgument(f"the parameters of {fn['name']!r} must be a JSON schema object")
        return cls(fn["name"], dict(params), str(fn.get("description") or ""))

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is JSON text, as in the OpenAI API."""

    id: str
    name: str
    arguments: str

    @property
    def args(self) -> Any:
        """The arguments, parsed."""
        return json.loads(self.arguments)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tools_from(tools: Iterable[object] | None) -> tuple[Tool, ...]:
    found = tuple(Tool.from_openai(t) for t in tools or ())
    names = [t.name for t in found]
    if len(set(names)) != len(names):
        raise InvalidArgument("two tools have the same name")
    return found


def check_choice(choice: object, tools: Sequence[Tool]) -> str:
    """``tool_choice`` as ``none``, ``auto``, ``required`` or a function name."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, Mapping):
            raise InvalidArgument('a named tool_choice is {"type": "function", "function": {...}}')
        name = fn.get("name")
        if name not in {t.name for t in tools}:
            raise InvalidArgument(f"tool_choice names {name!r}, which is not among the tools")
        return str(name)
    if choice not in ("none", "auto", "required"):
        raise InvalidArgument(
            f"tool_choice must be none, auto, required or a function, got {choice!r}"
        )
    if choice != "none" and not tools:
        raise InvalidArgument(f"tool_choice {choice!r} needs tools")
    return str(choice)


def tools_prompt(tools: Sequence[Tool], choice: str, json_answer: bool = False) -> str:
    """The system text that describes the tools and the call format (``json_answer``:
    a reply that calls nothing is JSON)."""
    lines = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    must = (
        "You must call a function now."
        if choice == "required"
        else f"You must call the function {choice} now."
        if choice != "auto"
        else "Call a function only when it helps to answer."
        + (" Otherwise answer with JSON only." if json_answer else "")
    )
    return (
        "You can call functions. They are described inside <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, answer with the call alone, in this form:\n"
        f'{TOOL_OPEN}{{"name": <function name>, "arguments": <an object>}}{TOOL_CLOSE}\n'
        f"{must}"
    )


def tools_grammar(tools: Sequence[Tool], choice: str, answer: object = None) -> Grammar | None:
    """The grammar for ``choice``: None for ``none``, lazy for ``auto``. With ``answer``
    (a JSON schema) under ``auto``, the reply is either a call or that schema's JSON."""
    if choice == "none":
        return None
    chosen = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    either = answer is not None and choice == "auto"
    return functions_grammar(
        [(t.name, dict(t.parameters)) for t in chosen],
        head=TOOL_OPEN,
        tail=TOOL_CLOSE,
        lazy=choice == "auto" and not either,
        answer=answer if either else None,
    )


def render_call(call: ToolCall) -> str:
    return f"{TOOL_OPEN}{CALL_PREFIX}{call.name}{CALL_ARGUMENTS}{call.arguments}}}{TOOL_CLOSE}"


def render_messages(
    messages: Iterable[Mapping[str, Any]],
    tools: Sequence[Tool],
    choice: str,
    template_tools: bool = False,
    json_answer: bool = False,
) -> tuple[Message, ...]:
    """OpenAI-shaped messages as the turns the chat template takes.

    By default (the documented format) assistant turns with ``tool_calls`` carry their
    calls in the text, ``tool`` turns become ``<tool_response>`` user turns, and the
    tools join the system message. With ``template_tools`` (the model's chat template
    renders tools itself, given them as ``tools_json``), calls stay ``tool_calls`` with
    their arguments as objects, ``tool`` turns stay ``tool`` turns, and no text is added.
    """
    out: list[Message] = []
    for m in messages:
        role = m.get("role")
        content = m.get("content") or ""
        calls = [_call_from(c) for c in m.get("tool_calls") or ()]
        if template_tools:
            turn: Message = {"role": str(role), "content": str(content)}
            if calls:
                turn["tool_calls"] = [_template_call(c) for c in calls]
            if role == "tool" and m.get("tool_call_id") is not None:
                turn["tool_call_id"] = str(m["tool_call_id"])
            out.append(turn)
            continue
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
            continue
        if calls:
            content = content + "".join(render_call(c) for c in calls)
        out.append({"role": str(role), "content": str(content)})
    if tools and choice != "none" and not template_tools:
        text = tools_prompt(tools, choice, json_answer)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return tuple(out)


def _template_call(call: ToolCall) -> dict[str, Any]:
    """A call as chat templates take it: the arguments an object (text if not JSON)."""
    try:
        args = call.args
    except ValueError:
        args = call.arguments
    fn = {"name": call.name, "arguments": args}
    return {"id": call.id, "type": "function", "function": fn}


def tools_json(tools: Sequence[Tool], choice: str, template_tools: bool) -> str | None:
    """The request's ``tools`` for a chat template that renders them (None otherwise,
    and for ``none``): the tools ``choice`` allows, OpenAI-shaped, as JSON text."""
    if not template_tools or choice == "none" or not tools:
        return None
    chosen = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    return json.dumps([t.to_openai() for t in chosen], ensure_ascii=False)


def _call_from(c: object) -> ToolCall:
    if isinstance(c, ToolCall):
        return c
    if not isinstance(c, Mapping) or not isinstance(c.get("function"), Mapping):
        raise InvalidArgument("a tool call is {id, type, function: {name, arguments}}")
    fn = c["function"]
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return ToolCall(str(c.get("id") or ""), str(fn.get("name")), args)


def split_call(body: str) -> tuple[str, str] | None:
    """``{"name": ..., "arguments": ...}`` as (name, the arguments' exact JSON text)."""
    body = body.lstrip()
    if body.startswith(CALL_PREFIX):  # the grammar's own form: keep the arguments' text
        name, sep, rest = body[len(CALL_PREFIX) :].partition(CALL_ARGUMENTS)
        if sep:
            try:
                _, end = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                return None
            return name, rest[:end]
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)


def parse_tool_calls(text: str, tools: Sequence[Tool]) -> tuple[str, list[ToolCall]]:
    """The reply's text before its call, and the call (if one parsed, of a known tool)."""
    found = _CALL.search(text)
    if found is None:
        return text, []
    parsed = split_call(found.group(1))
    if parsed is None or parsed[0] not in {t.name for t in tools}:
        return text, []
    return text[: found.start()], [ToolCall(new_call_id(), parsed[0], parsed[1])]


class CallStream:
    """Splits a streamed reply into text and one call, as the pieces come.

    ``feed`` and ``finish`` return events: ``("content", text)``, ``("call", name)`` once
    the name is known, then ``("arguments", text)`` pieces whose concatenation is the
    arguments' JSON text. Text that may be the start of a call is held back.
    """

    def __init__(self, constrained: bool) -> None:
        #: the whole reply is a call (``required`` or a named function)
        self.constrained = constrained
        self._text = ""  # free text not yet given out
        self._body: str | None = None  # everything after the opening tag
        self.name: str | None = None
        self._sent = ""  # arguments given out
        self.complete = False
        #: the reply ended inside a call (or inside its opening tag)
        self.cut = False
        self.content = ""

    def feed(self, piece: str) -> list[tuple[str, str]]:
        if self._body is None:
            self._text += piece
            at = self._text.find(TOOL_OPEN)
            if at < 0:
                return self._free(hold=not self.constrained)
            before, self._body = self._text[:at], self._text[at + len(TOOL_OPEN) :]
            self._text = ""
            events = [("content", before)] if before and not self.constrained else []
            self.content += before
            return events + self._call()
        self._body += piece
        return self._call()

    def _free(self, hold: bool) -> list[tuple[str, str]]:
        if self.constrained:
            return []
        keep = 0
        if hold:
            for n in range(min(len(TOOL_OPEN) - 1, len(self._text)), 0, -1):
                if self._text.endswith(TOOL_OPEN[:n]):
                    keep = n
                    break
        out, self._text = self._text[: len(self._text) - keep], self._text[len(self._text) - keep :]
        self.content += out
        return [("content", out)] if out else []

    def _call(self) -> list[tuple[str, str]]:
        assert self._body is not None
        events: list[tuple[str, str]] = []
        body = self._body.lstrip()
        if self.name is None:
            if not body.startswith(CALL_PREFIX):
                return events
            name, sep, _ = body[len(CALL_PREFIX) :].partition(CALL_ARGUMENTS)
            if not sep:
                return events
            self.name = name
            events.append(("call", name))
        args = body[len(CALL_PREFIX) + len(self.name) + len(CALL_ARGUMENTS) :]
        held = _HELD.search(args)
        ready = args[: held.start()] if held else args
        if len(ready) > len(self._sent) and ready.startswith(self._sent):
            events.append(("arguments", ready[len(self._sent) :]))
            self._sent = ready
        return events

    def finish(
        self, tools: Sequence[Tool], cut: bool = False
    ) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        """The events left at the end, and the call if the reply made one.

        ``cut``: the reply ended early (``max_tokens``, a stop string, a cancel). A call
        it cut short is still a call, its ``arguments`` the part that was written (as
        OpenAI's own), and ``self.cut`` says so; the markup never becomes text.
        """
        if self._body is None:
            if self.constrained and cut and TOOL_OPEN.startswith(self._text.strip()):
                self.cut = bool(self._text.strip())  # cut inside the opening tag
                self._text = ""
                return [], []
            if self.constrained:
                self.content += self._text
                return ([("content", self._text)] if self._text else []), []
            if cut:  # the reply may have ended inside the opening tag: drop that part
                given = self._free(hold=True)
                self.cut = bool(self._text)
                self._text = ""
                return given, []
            return self._free(hold=False), []
        found = parse_tool_calls(TOOL_OPEN + self._body, tools)[1]
        if not found:
            if self.name is None and not self.constrained and not cut:  # text after all
                rest = TOOL_OPEN + self._body
                self.content += rest
                return [("content", rest)], []
            self.cut = True
            if self.name is None or self.name not in {t.name for t in tools}:
                return [], []  # cut before its name was complete: nothing to name
            return self._partial()
        call = found[0]
        events: list[tuple[str, str]] = []
        if self.name is None:
            events.append(("call", call.name))
            self.name = call.name
        if call.arguments.startswith(self._sent) and len(call.arguments) > len(self._sent):
            events.append(("arguments", call.arguments[len(self._sent) :]))
        self.complete = True
        return events, [call]

    def _partial(self) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        """The call cut short: its arguments as far as they were written (exactly the
        arguments' JSON when only the call's closing was cut)."""
        assert self._body is not None
        assert self.name is not None
        body = self._body.lstrip()
        args = body[len(CALL_PREFIX) + len(self.name) + len(CALL_ARGUMENTS) :]
        try:
            _, end = json.JSONDecoder().raw_decode(args)
            args = args[:end]
        except ValueError:
            pass
        events: list[tuple[str, str]] = []
        if args.startswith(self._sent) and len(args) > len(self._sent):
            events.append(("arguments", args[len(self._sent) :]))
            self._sent = args
        return events, [ToolCall(new_call_id(), self.name, self._sent)]


@dataclass(frozen=True)
class Structure:
    """What an SDK request asks of its reply's shape: a JSON schema, or tools.

    ``parse`` gives the reply's parsed object (``schema``) or its calls (``tools``).
    """

    grammar: Grammar | None
    schema: Any = None
    tools: tuple[Tool, ...] = ()
    choice: str = "none"

    def parse(self, text: str, natural_stop: bool) -> tuple[Any, tuple[ToolCall, ...]]:
        """(parsed object or None, calls): None when the reply ended early or fails the
        schema's own validation (a pydantic model may check more than a grammar can)."""
        if self.tools and self.choice != "none":
            return None, tuple(parse_tool_calls(text, self.tools)[1]) if natural_stop else ()
        if self.schema is None or not natural_stop:
            return None, ()
        validate = getattr(self.schema, "model_validate_json", None)
        try:
            return (validate(text) if validate else json.loads(text)), ()
        except ValueError:  # pydantic's ValidationError is a ValueError too
            return None, ()


def structure(schema: Any = None, tools: Any = None, tool_choice: Any = None) -> Structure | None:
    """The ``Structure`` of SDK keyword arguments: ``schema`` (a pydantic model class, or
    a JSON schema as a dict), or ``tools`` (OpenAI-shaped dicts or ``Tool``) and
    ``tool_choice``. None when none is given."""
    if schema is None and tools is None:
        if tool_choice is not None:
            raise InvalidArgument("tool_choice needs tools")
        return None
    if schema is not None and tools is not None:
        raise InvalidArgument("give either a schema or tools, not both")
    if schema is not None:
        to_schema = getattr(schema, "model_json_schema", None)
        if callable(to_schema):
            return Structure(schema_grammar(to_schema()), schema=schema)
        if not isinstance(schema, Mapping):
            raise InvalidArgument("schema is a pydantic model class or a JSON schema dict")
        return Structure(schema_grammar(dict(schema)), schema=dict(schema))
    found = tools_from(tools)
    choice = check_choice(tool_choice, found)
    return Structure(tools_grammar(found, choice), tools=found, choice=choice)
