"""Tool calls in each family's own format over HTTP: the embedded model with its chat
template rewritten to Hermes, Llama 3.x and Mistral conventions (``tests/templates.py``)
is prompted, constrained and parsed in that family's call form, streamed and not."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

import plainhttp
from tokenbelt import Runtime
from tooling import WEATHER

from ..conftest import NET, Served, ServeFactory

pytestmark = pytest.mark.model

FAMILIES = ["hermes", "llama3", "mistral"]
MARKERS = ("<tool_call", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", '"name"')
#: how each family's call starts, as the model wrote it
OPENS = {
    "hermes": r"<tool_call>\n?\{\"name\": ",
    "llama3": r"(<\|python_tag\|>)?\n?\{\"name\": \"get_weather\", \"parameters\": ",
    "mistral": r"\[TOOL_CALLS\]\[\n?\{\"name\": \"get_weather\", \"arguments\": ",
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = WEATHER["function"]["parameters"]  # type: ignore[index]


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def served(serve: ServeFactory, native_model: Callable[[str], Path], family: str) -> Served:
    runtime = Runtime(keep_alive=None)
    runtime.load(str(native_model(family)))
    return serve(runtime)


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


def _create(client: openai.OpenAI, served: Served, **kwargs: Any) -> Any:
    base: dict[str, Any] = {"messages": ASK, "tools": [WEATHER], "temperature": 0}
    return client.chat.completions.create(model=served.model().name, **{**base, **kwargs})


def test_the_model_writes_its_familys_call_and_it_parses(served: Served, family: str) -> None:
    model = served.model()
    assert model.tool_format == family
    reply = model.complete(ASK, tools=[WEATHER], tool_choice="required", max_tokens=80)
    assert re.match(OPENS[family], reply.text), reply.text
    (call,) = reply.tool_calls
    jsonschema.validate(call.args, PARAMS)


def test_a_required_call_not_streamed(served: Served, client: openai.OpenAI, family: str) -> None:
    reply = _create(client, served, tool_choice="required", max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    if family == "mistral":
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    extension = (reply.model_extra or {})["tokenbelt"]
    assert extension["tool_format"] == family
    assert extension["tool_call_cut"] is False


def test_a_required_call_streamed_and_its_result_sent_back(
    served: Served, client: openai.OpenAI, family: str
) -> None:
    content, arguments, finish = "", "", None
    ids, names = [], []
    for chunk in _create(client, served, tool_choice="required", max_tokens=80, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            ids += [piece.id] if piece.id else []
            names += [piece.function.name] if piece.function and piece.function.name else []
            arguments += (piece.function.arguments or "") if piece.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert content == ""
    assert names == ["get_weather"]
    assert len(ids) == 1
    jsonschema.validate(json.loads(arguments), PARAMS)
    # The template renders the call back in its own form (Mistral's checks the id).
    call = {
        "id": ids[0],
        "type": "function",
        "function": {"name": names[0], "arguments": arguments},
    }
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": ids[0], "content": '{"sky": "clear"}'},
    ]
    final = _create(client, served, messages=messages, tool_choice="none", max_tokens=16)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content


def test_auto_leaks_no_marker_into_content(served: Served, client: openai.OpenAI) -> None:
    for stream in (False, True):
        content, arguments = "", ""
        if stream:
            for chunk in _create(client, served, tool_choice="auto", max_tokens=60, stream=True):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for piece in choice.delta.tool_calls or ():
                        arguments += piece.function.arguments or "" if piece.function else ""
        else:
            message = _create(client, served, tool_choice="auto", max_tokens=60).choices[0].message
            content = message.content or ""
            for call in message.tool_calls or ():
                arguments += call.function.arguments
        assert not any(m in content for m in MARKERS), content
        if arguments:
            json.loads(arguments)


def test_the_anthropic_route_says_the_format_too(served: Served, family: str) -> None:

    body = {
        "model": served.model().name,
        "max_tokens": 80,
        "messages": ASK,
        "tools": [{"name": "get_weather", "description": "The weather", "input_schema": PARAMS}],
        "tool_choice": {"type": "any"},
    }
    answer = plainhttp.post(f"{served.url}/v1/messages", json=body, timeout=NET).json()
    assert answer["tokenbelt"]["tool_format"] == family
    (block,) = [b for b in answer["content"] if b["type"] == "tool_use"]
    jsonschema.validate(block["input"], PARAMS)
