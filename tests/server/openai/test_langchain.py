"""langchain-openai against a real server: ``with_structured_output`` and ``bind_tools``.

langchain sends what applications send (a ``json_schema`` response format from a
pydantic model, OpenAI tool definitions) and parses the reply itself: a usable object
back means the wire shapes are right.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel, Field

from ..conftest import NET, Served, SharedServer, real_runtime, shared_server

langchain_openai = pytest.importorskip("langchain_openai")


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name", max_length=24)
    age: int
    city: str = Field(max_length=24)


class Weather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=32)
    unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    """One server for the module: its tests only send requests and read their replies."""
    with shared_server(real_runtime) as server:
        yield server


def chat_model(served: Served) -> object:
    return langchain_openai.ChatOpenAI(
        base_url=f"{served.url}/v1",
        api_key="x",
        model=served.model().name,
        max_tokens=150,
        timeout=NET,
        max_retries=0,
    )


def test_with_structured_output_returns_the_pydantic_object(served: Served) -> None:
    llm = chat_model(served).with_structured_output(Person)  # type: ignore[attr-defined]
    for prompt in ("Describe a baker from Lyon.", "Describe an old sailor."):
        person = llm.invoke(prompt)
        assert isinstance(person, Person)


def test_bind_tools_returns_valid_tool_calls(served: Served) -> None:
    llm = chat_model(served).bind_tools([Weather], tool_choice="required")  # type: ignore[attr-defined]
    message = llm.invoke("What is the weather in Paris?")
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "Weather"
    assert call["id"]
    jsonschema.validate(call["args"], Weather.model_json_schema())
    Weather.model_validate(call["args"])
    # And streamed: the chunks add up to the same kind of call.
    chunks = list(llm.stream("Is it raining in Oslo?"))
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    assert len(total.tool_calls) == 1
    Weather.model_validate(total.tool_calls[0]["args"])
    assert json.loads(total.tool_call_chunks[0]["args"]) == total.tool_calls[0]["args"]


class magic_function(BaseModel):  # langchain-tests' own tool, named as it names it
    """Apply a magic function to an input."""

    input: int = Field(gt=-1000, lt=1000)


def test_a_tool_with_a_bounded_argument_is_called_within_its_bounds(served: Served) -> None:
    # langchain-tests' standard tool-calling tests use this tool: refused with a 400
    # (``exclusiveMinimum``) until the grammar enforced integer ranges.
    llm = chat_model(served).bind_tools([magic_function], tool_choice="any")  # type: ignore[attr-defined]
    for prompt in ("What is the value of magic_function(3)?", "magic_function of 5000?"):
        message = llm.invoke(prompt)
        (call,) = message.tool_calls
        assert call["name"] == "magic_function"
        assert -1000 < magic_function.model_validate(call["args"]).input < 1000
