"""The SDK's ``schema=`` and ``tools=``, and the tool-call format under them.

The format's parsing is checked piece by piece (a stream may cut anywhere); the SDK
calls run on the real model, sync and async.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tokenbelt import EndReason, InvalidArgument, Model, Runtime
from tokenbelt.models import default_model_path
from tokenbelt.runtime._structured import (
    CallStream,
    Tool,
    ToolCall,
    check_choice,
    parse_tool_calls,
    render_messages,
    tools_from,
)
from tooling import WEATHER

TOOLS = tools_from([WEATHER])
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris {1}"} }</tool_call>'


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int


# -- the format -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(CALL)])
def test_a_call_streams_in_pieces_wherever_the_text_is_cut(size: int) -> None:
    calls = CallStream(constrained=True)
    events = []
    for i in range(0, len(CALL), size):
        events += calls.feed(CALL[i : i + size])
    tail, found = calls.finish(TOOLS)
    events += tail
    assert events[0] == ("call", "get_weather")
    arguments = "".join(text for kind, text in events if kind == "arguments")
    assert arguments == '{"city": "Paris {1}"}'
    assert [kind for kind, _ in events].count("call") == 1
    assert found == [ToolCall(found[0].id, "get_weather", arguments)]
    assert calls.complete


def test_auto_streams_text_and_holds_back_what_may_open_a_call() -> None:
    calls = CallStream(constrained=False)
    events = calls.feed("Let me check. <tool")
    assert events == [("content", "Let me check. ")]
    events += calls.feed("_call>" + CALL[len("<tool_call>") :])
    tail, found = calls.finish(TOOLS)
    assert found
    assert ("call", "get_weather") in events + tail
    plain = CallStream(constrained=False)
    assert plain.feed("a <to") == [("content", "a ")]
    assert plain.finish(TOOLS) == ([("content", "<to")], [])  # it was text after all


def test_a_call_that_did_not_complete_is_no_call() -> None:
    calls = CallStream(constrained=True)
    calls.feed(CALL[:40])
    assert calls.finish(TOOLS)[1] == []
    assert parse_tool_calls(CALL[:40], TOOLS) == (CALL[:40], [])
    text, found = parse_tool_calls("Sure. " + CALL, TOOLS)
    assert text == "Sure. "
    assert found[0].args == {"city": "Paris {1}"}
    unknown = CALL.replace("get_weather", "launch")
    assert parse_tool_calls(unknown, TOOLS) == (unknown, [])


def test_turns_with_calls_and_results_render_as_plain_turns() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    turns = render_messages(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        TOOLS,
        "auto",
    )
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in turns[0]["content"]
    assert "<tools>" in turns[0]["content"]
    assert parse_tool_calls(turns[2]["content"], TOOLS)[1][0].args == {"city": "Oslo"}
    assert turns[3]["content"] == "<tool_response>\nrain\n</tool_response>"
    # none: no tools described
    assert render_messages([{"role": "user", "content": "x"}], TOOLS, "none") == (
        {"role": "user", "content": "x"},
    )


def test_bad_tools_and_choices_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="function tools"):
        tools_from([{"type": "retrieval"}])
    with pytest.raises(InvalidArgument, match="same name"):
        tools_from([WEATHER, WEATHER])
    with pytest.raises(InvalidArgument, match="not among"):
        check_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(InvalidArgument, match="needs tools"):
        check_choice("required", ())
    assert check_choice(None, TOOLS) == "auto"
    assert Tool.from_openai(WEATHER).to_openai() == WEATHER


# -- the SDK on the real model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    with Runtime(keep_alive=None) as runtime:
        yield runtime.load(str(default_model_path()))


@pytest.mark.model
def test_the_embedded_models_template_has_no_tools_so_the_documented_format_is_used(
    model: Model,
) -> None:
    assert not model.template_tools


@pytest.mark.model
def test_send_with_a_pydantic_schema_returns_the_object(model: Model) -> None:
    with model.chat() as chat:
        reply = chat.send("Describe a baker.", schema=Person, max_tokens=120, seed=1)
        assert reply.end_reason is EndReason.STOP
        assert isinstance(reply.parsed, Person)
        assert reply.parsed == Person.model_validate_json(reply.text)
        cut = chat.send("Describe a sailor.", schema=Person, max_tokens=3)
        assert cut.end_reason is EndReason.LENGTH
        assert cut.parsed is None  # ended early: the text as it is, no object


@pytest.mark.model
def test_asend_with_a_dict_schema_and_model_stream(model: Model) -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "colours": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "maxItems": 3,
            }
        },
        "required": ["colours"],
    }

    async def ask() -> Any:
        chat = model.achat()
        async with chat:
            return await chat.asend("Name colours.", schema=schema, max_tokens=120)

    reply = anyio.run(ask)
    jsonschema.validate(reply.parsed, schema)
    streamed = model.stream(
        [{"role": "user", "content": "Colours?"}], schema=schema, max_tokens=120
    )
    reply = streamed.read()
    assert reply.parsed == json.loads(reply.text)


@pytest.mark.model
def test_a_tool_round_trip_in_a_session(model: Model) -> None:
    with model.chat() as chat:
        reply = chat.send(
            "Weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=80
        )
        assert reply.finish_reason == "tool_calls"
        (call,) = reply.tool_calls
        assert call.name == "get_weather"
        jsonschema.validate(call.args, WEATHER["function"]["parameters"])  # type: ignore[index]
        answer = chat.send('{"sky": "clear"}', tool_call_id=call.id, max_tokens=30)
        assert answer.tool_calls == ()
        assert answer.text
        assert chat.history[-2]["content"] == '<tool_response>\n{"sky": "clear"}\n</tool_response>'
    with pytest.raises(InvalidArgument, match="either a schema or tools"):
        model.stream([{"role": "user", "content": "x"}], schema=Person, tools=[WEATHER])
