"""Each tool-call family's form: detection from the template, the grammar's triggers,
the parse and the stream split (no model: fast)."""

from __future__ import annotations

import json
import re

import pytest

from templates import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE
from tokenbelt.engines import format_of_template, functions_grammar
from tokenbelt.runtime._structured import (
    CallStream,
    ToolCall,
    parse_tool_calls,
    render_call,
    tools_from,
    tools_grammar,
)
from tooling import WEATHER, trigger_fires, trigger_matches

TOOLS = tools_from([WEATHER])
ARGS = '{"city": "Paris {1]"}'
#: each family's call, as its grammar writes it and as models write it otherwise
CALLS = {
    "hermes": [f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'],
    "llama3": [
        f'{{"name": "get_weather", "parameters": {ARGS}}}',
        f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}',
        f'<|python_tag|>{{"name":"get_weather","arguments":{ARGS}}}',
    ],
    "mistral": [
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}]',
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}, "id": "a1b2c3d4e"}}]',
    ],
}
MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", '{"name"')
CASES = [(family, call) for family, calls in CALLS.items() for call in calls]


def test_the_family_is_read_from_the_template() -> None:
    qwen = "{% if tools %}{{ tools | tojson }} <tool_call>{% endif %}"
    llama31 = "{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|>{{ m }}<|eom_id|>"
    assert format_of_template(qwen) == "hermes"
    assert format_of_template(llama31) == "llama3"
    assert format_of_template(LLAMA3_TEMPLATE) == "llama3"
    assert format_of_template(MISTRAL_TEMPLATE) == "mistral"
    assert format_of_template("{{ tools }}: answer in JSON") == "tokenbelt"
    # A template that does not render tools gets the documented format, whatever it says.
    assert format_of_template("[TOOL_CALLS]{{ messages }}") == "tokenbelt"
    assert format_of_template("{% if %}") == "tokenbelt"


@pytest.mark.parametrize(("family", "call"), CASES)
def test_a_call_parses_in_its_familys_form(family: str, call: str) -> None:
    text, found = parse_tool_calls(call, TOOLS, family)
    assert text == ""
    assert [(c.name, c.args) for c in found] == [("get_weather", json.loads(ARGS))]


def test_text_before_a_call_and_calls_that_are_no_calls() -> None:
    text, found = parse_tool_calls("Let me look. " + CALLS["llama3"][1], TOOLS, "llama3")
    assert (text, found[0].name) == ("Let me look. ", "get_weather")
    # Bare JSON is a Llama 3.x call only as the whole reply.
    prose = "Here: " + CALLS["llama3"][0]
    assert parse_tool_calls(prose, TOOLS, "llama3") == (prose, [])
    cut = CALLS["mistral"][0][:-1]  # no closing bracket
    assert parse_tool_calls(cut, TOOLS, "mistral") == (cut, [])
    other = CALLS["hermes"][0]  # another family's form is text
    assert parse_tool_calls(other, TOOLS, "mistral") == (other, [])


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    (call,) = parse_tool_calls(CALLS["mistral"][0], TOOLS, "mistral")[1]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    assert parse_tool_calls(CALLS["hermes"][0], TOOLS, "hermes")[1][0].id.startswith("call_")


@pytest.mark.parametrize("family", ["tokenbelt", "hermes", "llama3", "mistral"])
def test_the_grammars_own_form_round_trips(family: str) -> None:
    text = render_call(ToolCall("x", "get_weather", ARGS), family)
    assert parse_tool_calls(text, TOOLS, family)[1][0].arguments == ARGS


def _events(stream: CallStream, text: str, size: int) -> list[tuple[str, str]]:
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i : i + size])
    return events + stream.finish(TOOLS)[0]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize(("family", "call"), CASES)
def test_a_streamed_call_in_any_cut_of_pieces(family: str, call: str, size: int) -> None:
    for constrained, before in ((True, ""), (False, ""), (False, "Sure. ")):
        if family == "llama3" and before and not call.startswith("<|"):
            continue  # bare JSON after text is text
        stream = CallStream(constrained, family)
        events = _events(stream, before + call, size)
        content = "".join(t for kind, t in events if kind == "content")
        assert content == before
        assert [kind for kind, _ in events].count("call") == 1
        arguments = "".join(t for kind, t in events if kind == "arguments")
        assert json.loads(arguments) == json.loads(ARGS)
        assert stream.complete


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_free_text_under_auto_keeps_no_marker_and_loses_nothing(family: str) -> None:
    for text in ("  Hello there [TOOL <|py {x} <tool", "{not a call}", "[TOOL_CALLS] no"):
        stream = CallStream(False, family)
        events = _events(stream, text, 3)
        assert "".join(t for kind, t in events if kind == "content") == text
        assert not stream.cut
    stream = CallStream(False, family)
    assert stream.feed("A") == [("content", "A")]  # text is not held back for nothing


@pytest.mark.parametrize(("family", "call"), CASES)
def test_a_call_cut_short_is_a_cut_call_and_never_content(family: str, call: str) -> None:
    for end in range(1, len(call)):
        stream = CallStream(False, family)
        events = stream.feed(call[:end])
        more, _ = stream.finish(TOOLS, cut=True)
        content = "".join(t for kind, t in events + more if kind == "content")
        assert not any(m in content for m in MARKERS), (end, content)
        assert content.strip() == "" or call.startswith(content)


def test_each_familys_lazy_trigger_fires_at_its_marker_only() -> None:
    def fires(family: str, text: str) -> bool:
        grammar = tools_grammar(TOOLS, "auto", tool_format=family)
        assert grammar is not None
        assert grammar.triggers
        return trigger_fires(grammar, text)

    assert fires("llama3", "Let me see <|python_tag|>")
    assert fires("llama3", '  {"na')
    assert not fires("llama3", 'Text {"name": "')
    assert fires("mistral", "ok [TOOL_CALLS]")
    assert fires("mistral", '[TOOL_CALLS][{"name')
    assert not fires("mistral", "The weather, maybe. " * 40 + "[TOOL_CALL")
    # A piece carrying the marker and text the call cannot start with never fires.
    mistral = tools_grammar(TOOLS, "auto", tool_format="mistral")
    assert mistral is not None
    assert not trigger_matches(mistral.triggers[0], "ok [TOOL_CALLS] maybe")
    assert fires("hermes", '<tool_call>\n{"')
    llama = tools_grammar(TOOLS, "required", tool_format="llama3")
    assert llama is not None
    assert '\\"parameters\\": ' in llama.gbnf
    assert functions_grammar([("f", {})], head="<x>", tail="", lazy=True).triggers
