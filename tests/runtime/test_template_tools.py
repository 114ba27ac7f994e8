"""Tool calls on a model whose own chat template renders tools.

The model is the embedded one with its ``tokenizer.chat_template`` replaced by a small
Hermes-style template that describes ``tools`` in the system turn: the prompt must be
that template's rendering (not the documented ``<tools>`` system text), and the calls
still come back in the documented ``<tool_call>`` form that the grammar enforces.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tokenbelt import Model, Runtime
from tokenbelt.engines import GenerationRequest, load_vocab, template_tools
from tokenbelt.runtime._structured import render_messages, tools_from, tools_json
from tooling import WEATHER

#: what the template (``tests/conftest.py``) says of the tools; the documented text does not
OWN_WORDS = "# Tools\n\nYou may call one or more functions to assist with the user query."
DOCUMENTED_WORDS = "You can call functions. They are described inside <tools></tools>"


@pytest.fixture(scope="module")
def model(tool_template_model: Path) -> Iterator[Model]:
    with Runtime(keep_alive=None) as runtime:
        yield runtime.load(str(tool_template_model))


def _prompt_text(model: Model, request: GenerationRequest, path: Path) -> str:
    """The prompt the model's engine builds for ``request``, as text."""
    engine = model.engines[0]
    tokens = engine.tokenize_request(request)  # type: ignore[attr-defined]
    vocab = load_vocab(path)
    try:
        return vocab.detokenize(tokens, special=True).decode("utf-8")
    finally:
        vocab.close()


def test_which_templates_render_tools() -> None:
    class Formatter:
        def __init__(self, template: str) -> None:
            self.template = template

    assert template_tools(Formatter("{% if tools %}{{ tools | tojson }}{% endif %}"))
    assert not template_tools(Formatter("{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert not template_tools(Formatter("{% if %}"))  # does not parse: the documented format
    assert not template_tools(None)


def test_template_turns_keep_calls_and_tool_results() -> None:
    tools = tools_from([WEATHER])
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1"},
    ]
    turns = render_messages(messages, tools, "auto", template_tools=True)
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert turns[2]["tool_call_id"] == "call_1"
    assert json.loads(tools_json(tools, "auto", True) or "") == [WEATHER]
    assert tools_json(tools, "auto", False) is None
    assert tools_json(tools, "none", True) is None


@pytest.mark.model
def test_the_prompt_is_the_templates_own_rendering_of_the_tools(
    model: Model, tool_template_model: Path
) -> None:
    assert model.template_tools
    tools = tools_from([WEATHER])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1"},
    ]
    request = GenerationRequest(
        messages=render_messages(messages, tools, "required", True),
        tools=tools_json(tools, "required", True),
    )
    text = _prompt_text(model, request, tool_template_model)
    assert OWN_WORDS in text
    assert json.dumps(tools[0].to_openai()) in text  # the template's ``tojson`` of it
    assert DOCUMENTED_WORDS not in text
    assert "Be brief." in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in text
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in text


@pytest.mark.model
def test_a_required_call_on_the_templates_format_is_a_valid_call(model: Model) -> None:
    for _ in range(3):
        reply = model.complete(
            "Weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=80
        )
        assert reply.finish_reason == "tool_calls"
        (call,) = reply.tool_calls
        assert call.name == "get_weather"
        jsonschema.validate(call.args, WEATHER["function"]["parameters"])  # type: ignore[index]


@pytest.mark.model
def test_a_session_round_trip_keeps_tool_turns_for_the_template(model: Model) -> None:
    with model.chat() as chat:
        reply = chat.send(
            "Weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=80
        )
        (call,) = reply.tool_calls
        answer = chat.send('{"sky": "clear"}', tool_call_id=call.id, max_tokens=20)
        assert answer.tool_calls == ()
        assert chat.history[-2] == {
            "role": "tool",
            "content": '{"sky": "clear"}',
            "tool_call_id": call.id,
        }


@pytest.mark.model
def test_a_worker_process_engine_builds_the_same_prompt(
    model: Model, tool_template_model: Path
) -> None:
    tools = tools_from([WEATHER])
    request = GenerationRequest(
        messages=render_messages([{"role": "user", "content": "Hi"}], tools, "required", True),
        tools=tools_json(tools, "required", True),
    )
    with Runtime(keep_alive=None, isolation="process") as runtime:
        isolated = runtime.load(str(tool_template_model))
        assert isolated.template_tools
        text = _prompt_text(isolated, request, tool_template_model)
        assert text == _prompt_text(model, request, tool_template_model)
        assert OWN_WORDS in text
        reply = isolated.complete("Weather in Paris?", tools=[WEATHER], tool_choice="required")
        assert reply.finish_reason == "tool_calls"
        jsonschema.validate(reply.tool_calls[0].args, WEATHER["function"]["parameters"])  # type: ignore[index]
