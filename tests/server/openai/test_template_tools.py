"""Tool calls over HTTP on a model whose own chat template renders tools (the embedded
model with the Hermes-style template of ``tests/conftest.py`` put in)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tokenbelt import Runtime
from tooling import WEATHER

from ..conftest import NET, Served, ServeFactory


@pytest.fixture
def served(serve: ServeFactory, tool_template_model: Path) -> Served:
    runtime = Runtime(keep_alive=None)
    runtime.load(str(tool_template_model))
    return serve(runtime)


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


def test_a_required_call_and_its_result_over_http(served: Served, client: openai.OpenAI) -> None:
    model = served.model()
    assert model.template_tools
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=model.name, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=80
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(args, WEATHER["function"]["parameters"])  # type: ignore[index]
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'})
    final = client.chat.completions.create(
        model=model.name, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=20
    )
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content
