"""How a tool call is written and named: each family's call format (``CallFormat``, one
per name of ``TOOL_FORMATS``), a tool (``Tool``) and a call the model made (``ToolCall``).

``_structured.py`` builds the prompts, grammars and parsers on these.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidArgument
from ..engines import TOOL_FORMATS, call_arguments

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def _prefixes(text: str) -> str:
    """A regex matching any prefix of ``text`` (the empty one too)."""
    out = ""
    for ch in reversed(text):
        out = f"(?:{re.escape(ch)}{out})?"
    return out


@dataclass(frozen=True)
class CallFormat:
    """How one tool-call family writes a call: ``head``, the call's JSON
    ``{"name": "f", "<key>": {...}}``, ``tail``."""

    #: the family's name (one of ``TOOL_FORMATS``), said in ``tokenbelt.tool_format``
    name: str
    head: str
    #: what closes a call ("": the call ends the reply)
    tail: str
    #: the arguments' key in the call's JSON
    key: str = "arguments"
    #: what starts a call in free text (None: all of ``head``)
    marker: str | None = None
    #: the call may come without ``head``, as the reply's JSON (Llama 3.x)
    optional_head: bool = False
    #: call ids are this many letters and digits (Mistral's templates check it)
    id_length: int | None = None

    @property
    def opens(self) -> str:
        return self.head if self.marker is None else self.marker

    @property
    def separator(self) -> str:
        """What separates the name from the arguments in the grammar's form."""
        return call_arguments(self.key)

    @property
    def held(self) -> re.Pattern[str]:
        """What may follow the arguments' last character: braces, spaces, the tail."""
        return _held(self.tail)

    def new_id(self) -> str:
        if self.id_length is None:
            return new_call_id()
        alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        return "".join(secrets.choice(alphabet) for _ in range(self.id_length))


@functools.lru_cache(maxsize=8)
def _held(tail: str) -> re.Pattern[str]:
    return re.compile(r"(?:\}\s*)+" + _prefixes(tail) + "$")


FORMATS = {
    f.name: f
    for f in (
        CallFormat("tokenbelt", TOOL_OPEN, TOOL_CLOSE),
        CallFormat("hermes", TOOL_OPEN, TOOL_CLOSE),
        CallFormat("llama3", "<|python_tag|>", "", key="parameters", optional_head=True),
        CallFormat("mistral", "[TOOL_CALLS][", "]", marker="[TOOL_CALLS]", id_length=9),
    )
}
assert tuple(FORMATS) == TOOL_FORMATS


def call_format(name: str | CallFormat = "tokenbelt") -> CallFormat:
    """The ``CallFormat`` of a family's name (``TOOL_FORMATS``)."""
    if isinstance(name, CallFormat):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        known = ", ".join(TOOL_FORMATS)
        raise InvalidArgument(f"no tool-call format {name!r}; the formats are {known}") from None


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
        """The arguments, parsed; ``{}`` where they are not whole JSON (a call the reply's
        length cut off: its ``arguments`` keep what was made)."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)
