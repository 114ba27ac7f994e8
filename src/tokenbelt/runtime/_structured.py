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

A model whose template renders tools in a family's own call format
(``Model.tool_format``) is generated and parsed in that format (``CallFormat``):

- ``hermes`` (Hermes, Qwen): the ``<tool_call>`` JSON above;
- ``llama3`` (Llama 3.1/3.2): ``{"name": "f", "parameters": {...}}``, with or without
  ``<|python_tag|>`` before it, ending the reply;
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}]`` (call ids are nine
  letters and digits, as Mistral's templates require).

Otherwise (``tokenbelt``, the fallback) a call is the ``<tool_call>`` JSON above. The
grammar enforces whichever form it is; an earlier call goes back to the template as
``tool_calls``, which it renders in its own format.

``tool_choice``: ``none`` describes no tools and constrains nothing; ``required`` and a
named function constrain the whole reply to one call; ``auto`` leaves the text free
until the reply starts a call (a lazy grammar triggered by ``<tool_call>``), and from
there the call is constrained (Llama 3.x: also when the reply starts with the call's
JSON). One call per reply.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidArgument
from ..engines import (
    CALL_PREFIX,
    Grammar,
    Message,
    call_arguments,
    functions_grammar,
    schema_grammar,
)
from ._calls import TOOL_CLOSE, TOOL_OPEN, call_format
from ._calls import CallFormat as CallFormat  # reached as ``structured.CallFormat``
from ._calls import Tool as Tool
from ._calls import ToolCall as ToolCall
from ._validation import SchemaCheck as SchemaCheck  # reached as ``structured.SchemaCheck``
from ._validation import check_reply as check_reply


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


def tools_grammar(
    tools: Sequence[Tool],
    choice: str,
    answer: object = None,
    tool_format: str | CallFormat = "tokenbelt",
) -> Grammar | None:
    """The grammar for ``choice`` in ``tool_format``'s call form: None for ``none``, lazy
    for ``auto``. With ``answer`` (a JSON schema) under ``auto``, the reply is either a
    call or that schema's JSON."""
    if choice == "none":
        return None
    fmt = call_format(tool_format)
    chosen = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    either = answer is not None and choice == "auto"
    return functions_grammar(
        [(t.name, dict(t.parameters)) for t in chosen],
        head=fmt.head,
        tail=fmt.tail,
        lazy=choice == "auto" and not either,
        answer=answer if either else None,
        key=fmt.key,
        marker=fmt.marker,
        optional_head=fmt.optional_head,
    )


def render_call(call: ToolCall, tool_format: str | CallFormat = "tokenbelt") -> str:
    """A call as ``tool_format`` writes it (the grammar's own form)."""
    fmt = call_format(tool_format)
    body = f"{CALL_PREFIX}{call.name}{fmt.separator}{call.arguments}}}"
    return f"{fmt.head}{body}{fmt.tail}"


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


def unanswered(
    messages: Sequence[Mapping[str, Any]], *, anywhere: bool = False
) -> tuple[int, str] | None:
    """The first ``tool`` turn that answers no call, as (its index, its ``tool_call_id``),
    or None: its id must be one of the ``tool_calls`` of the assistant turn before it
    (other tool turns may come between, as OpenAI's chat and Anthropic's messages
    require), or with ``anywhere`` of any assistant turn before it (the Responses API's
    rule). A result that answers nothing is a client's bug the model should not be
    shown: the APIs tokenbelt speaks refuse it."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            ids = {str(c.get("id")) for c in m.get("tool_calls") or ()}
            made = made | ids if anywhere else ids
        elif role == "tool":
            answered = str(m.get("tool_call_id"))
            if answered not in made:
                return i, answered
        elif not anywhere:
            made = set()
    return None


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


def split_call(body: str, key: str = "arguments") -> tuple[str, str] | None:
    """``{"name": ..., "<key>": ...}`` as (name, the arguments' exact JSON text); text
    after the object is ignored."""
    found = _decode_call(body, key)
    return None if found is None else found[:2]


def _decode_call(body: str, key: str) -> tuple[str, str, int] | None:
    """(name, arguments' JSON text, where the call's object ends in ``body``)."""
    lead = len(body) - len(body.lstrip())
    body = body[lead:]
    separator = call_arguments(key)
    if body.startswith(CALL_PREFIX):  # the grammar's own form: keep the arguments' text
        name, sep, rest = body[len(CALL_PREFIX) :].partition(separator)
        if sep:
            try:
                _, end = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                pass
            else:
                after = rest[end:]
                close = len(after) - len(after.lstrip())
                if after[close : close + 1] == "}":
                    at = lead + len(CALL_PREFIX) + len(name) + len(sep) + end + close + 1
                    return name, rest[:end], at
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    # A model may use the other family's key; either is its arguments.
    args = obj.get(key, obj.get("arguments" if key != "arguments" else "parameters", {}))
    return obj["name"], json.dumps(args, ensure_ascii=False), lead + end


def _opening(text: str, fmt: CallFormat, at_start: bool) -> tuple[int, int] | None:
    """Where a call opens in ``text``: (its start, where its marker ends); None if no
    call opens there (yet). ``at_start``: ``text`` is the reply's beginning."""
    at = text.find(fmt.opens)
    if at >= 0:
        return at, at + len(fmt.opens)
    if fmt.optional_head and at_start and text.lstrip().startswith("{"):
        return 0, len(text) - len(text.lstrip())
    return None


def _json_part(body: str, fmt: CallFormat) -> tuple[str, bool]:
    """The call's JSON after its marker: (the text from there, whether the rest of the
    head is complete). Mistral's head goes on past its marker with ``[``."""
    body = body.lstrip()
    rest = fmt.head[len(fmt.opens) :]
    if not rest:
        return body, True
    if body.startswith(rest):
        return body[len(rest) :].lstrip(), True
    return body, False


def parse_tool_calls(
    text: str, tools: Sequence[Tool], tool_format: str | CallFormat = "tokenbelt"
) -> tuple[str, list[ToolCall]]:
    """The reply's text before its call, and the call (if one parsed, of a known tool),
    in ``tool_format``'s form."""
    fmt = call_format(tool_format)
    found = _opening(text, fmt, at_start=True)
    if found is None:
        return text, []
    start, body_at = found
    body, headed = _json_part(text[body_at:], fmt)
    call = _decode_call(body, fmt.key) if headed else None
    if call is None or call[0] not in {t.name for t in tools}:
        return text, []
    after = body[call[2] :].lstrip()
    if fmt.tail and not after.startswith(fmt.tail):
        return text, []
    return text[:start], [ToolCall(fmt.new_id(), call[0], call[1])]


class CallStream:
    """Splits a streamed reply into text and one call, as the pieces come.

    ``feed`` and ``finish`` return events: ``("content", text)``, ``("call", name)`` once
    the name is known, then ``("arguments", text)`` pieces whose concatenation is the
    arguments' JSON text. Text that may be the start of a call (``tool_format``'s
    marker, or for Llama 3.x the reply's JSON) is held back, so no marker reaches
    content.
    """

    def __init__(self, constrained: bool, tool_format: str | CallFormat = "tokenbelt") -> None:
        #: the whole reply is a call (``required`` or a named function)
        self.constrained = constrained
        self.format = call_format(tool_format)
        self._text = ""  # free text not yet given out
        self._opened = ""  # the call's opening as written (its marker)
        self._body: str | None = None  # everything after the opening
        self.name: str | None = None
        self._sent = ""  # arguments given out
        self.complete = False
        #: the reply ended inside a call (or inside its opening)
        self.cut = False
        self.content = ""
        self._given = False  # some free text was given out: a bare JSON call cannot start

    def feed(self, piece: str) -> list[tuple[str, str]]:
        if self._body is None:
            self._text += piece
            found = _opening(self._text, self.format, at_start=not self._given)
            if found is None:
                return self._free(hold=not self.constrained)
            at, body_at = found
            before = self._text[:at]
            self._opened, self._body = self._text[at:body_at], self._text[body_at:]
            self._text = ""
            events = [("content", before)] if before and not self.constrained else []
            self.content += before
            return events + self._call()
        self._body += piece
        return self._call()

    def _keep(self) -> int:
        """How much of the free text's end may still open a call."""
        text, fmt = self._text, self.format
        if fmt.optional_head and not self._given and not text.strip():
            return len(text)  # spaces before a bare JSON call are the call's
        marker = fmt.opens
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                return n
        return 0

    def _free(self, hold: bool) -> list[tuple[str, str]]:
        if self.constrained:
            return []
        keep = self._keep() if hold else 0
        out, self._text = self._text[: len(self._text) - keep], self._text[len(self._text) - keep :]
        self.content += out
        self._given = self._given or bool(out)
        return [("content", out)] if out else []

    def _arguments(self) -> str | None:
        """The arguments' text written so far, once the name is known (None before)."""
        assert self._body is not None
        if self.name is None:
            return None
        body = _json_part(self._body, self.format)[0]
        return body[len(CALL_PREFIX) + len(self.name) + len(self.format.separator) :]

    def _call(self) -> list[tuple[str, str]]:
        assert self._body is not None
        events: list[tuple[str, str]] = []
        body, headed = _json_part(self._body, self.format)
        if self.name is None:
            if not headed or not body.startswith(CALL_PREFIX):
                return events
            name, sep, _ = body[len(CALL_PREFIX) :].partition(self.format.separator)
            if not sep:
                return events
            self.name = name
            events.append(("call", name))
        args = self._arguments() or ""
        held = self.format.held.search(args)
        ready = args[: held.start()] if held else args
        if "}" in args:  # complete arguments end there: what follows is not theirs
            with contextlib.suppress(ValueError):
                ready = args[: json.JSONDecoder().raw_decode(args)[1]]
        if len(ready) > len(self._sent) and ready.startswith(self._sent):
            events.append(("arguments", ready[len(self._sent) :]))
            self._sent = ready
        return events

    def _could_open(self, text: str) -> bool:
        """Whether ``text`` is no more than the start of a call's opening."""
        text = text.strip()
        fmt = self.format
        return fmt.head.startswith(text) or (fmt.optional_head and CALL_PREFIX.startswith(text))

    def finish(
        self, tools: Sequence[Tool], cut: bool = False
    ) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        """The events left at the end, and the call if the reply made one.

        ``cut``: the reply ended early (``max_tokens``, a stop string, a cancel). A call
        it cut short is still a call, its ``arguments`` the part that was written (as
        OpenAI's own), and ``self.cut`` says so; the markup never becomes text.
        """
        if self._body is None:
            if self.constrained and cut and self._could_open(self._text):
                self.cut = bool(self._text.strip())  # cut inside the opening
                self._text = ""
                return [], []
            if self.constrained:
                self.content += self._text
                return ([("content", self._text)] if self._text else []), []
            if cut:  # the reply may have ended inside the opening: drop that part
                given = self._free(hold=True)
                self.cut = bool(self._text.strip())
                self._text = ""
                return given, []
            return self._free(hold=False), []
        found = parse_tool_calls(self._opened + self._body, tools, self.format)[1]
        if not found:
            if self.name is None and not self.constrained and not cut:  # text after all
                rest = self._opened + self._body
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
        assert self.name is not None
        args = self._arguments() or ""
        try:
            _, end = json.JSONDecoder().raw_decode(args)
            args = args[:end]
        except ValueError:
            pass
        events: list[tuple[str, str]] = []
        if args.startswith(self._sent) and len(args) > len(self._sent):
            events.append(("arguments", args[len(self._sent) :]))
            self._sent = args
        return events, [ToolCall(self.format.new_id(), self.name, self._sent)]


@dataclass(frozen=True)
class Structure:
    """What an SDK request asks of its reply's shape: a JSON schema, or tools.

    ``parse`` gives the reply's parsed object (``schema``) or its calls (``tools``).
    """

    grammar: Grammar | None
    schema: Any = None
    tools: tuple[Tool, ...] = ()
    choice: str = "none"
    #: the family the calls are written in (``CallFormat``)
    tool_format: str = "tokenbelt"

    def parse(self, text: str, natural_stop: bool) -> tuple[Any, tuple[ToolCall, ...]]:
        """(parsed object or None, calls): None when the reply ended early or fails the
        schema's own validation (a pydantic model may check more than a grammar can)."""
        if self.tools and self.choice != "none":
            return None, tuple(
                parse_tool_calls(text, self.tools, self.tool_format)[1]
            ) if natural_stop else ()
        if self.schema is None or not natural_stop:
            return None, ()
        validate = getattr(self.schema, "model_validate_json", None)
        try:
            return (validate(text) if validate else json.loads(text)), ()
        except ValueError:  # pydantic's ValidationError is a ValueError too
            return None, ()


def structure(
    schema: Any = None,
    tools: Any = None,
    tool_choice: Any = None,
    tool_format: str = "tokenbelt",
) -> Structure | None:
    """The ``Structure`` of SDK keyword arguments: ``schema`` (a pydantic model class, or
    a JSON schema as a dict), or ``tools`` (OpenAI-shaped dicts or ``Tool``) and
    ``tool_choice``, the calls in ``tool_format`` (the model's). None when none is given."""
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
    grammar = tools_grammar(found, choice, tool_format=tool_format)
    return Structure(grammar, tools=found, choice=choice, tool_format=tool_format)
