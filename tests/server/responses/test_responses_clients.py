"""``/v1/responses`` with the real model and the clients agents use: openai-agents with
its default (Responses) provider, the ``openai`` SDK's create/stream/parse, and a
request shaped like Codex's (stateless, long instructions, the whole transcript)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

import plainhttp
from tokenbelt import EndReason
from tokenbelt.models import default_model_path
from tokenbelt.server import ServerSettings

from ..conftest import NET, Served, SharedServer, real_runtime, shared_server

#: the name a runtime gives a model loaded from its file
MODEL = default_model_path().stem
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 32}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class City(BaseModel):
    # Bounded, so the grammar bounds the reply: a sampled name may otherwise run past
    # the agent's token budget and end the response incomplete.
    name: str = Field(max_length=40)
    population: int = Field(ge=0, le=10**10)


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    settings = ServerSettings(responses_store_bytes=4 << 20)
    with shared_server(lambda: real_runtime(slots=2), settings) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


# -- openai-agents, default provider ---------------------------------------------------------


def test_openai_agents_runs_a_tool_and_answers(served: Served) -> None:
    import agents

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"sunny and 21 C in {city}"

    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=MODEL,
        model_settings=agents.ModelSettings(
            tool_choice="required", max_tokens=48, extra_body={"seed": 7}
        ),
    )

    async def run() -> tuple[Any, Any]:
        async with client:
            blocking = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
            streamed = agents.Runner.run_streamed(agent, "Weather in Rome?", max_turns=3)
            kinds = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in kinds
        return blocking, streamed

    blocking, streamed = asyncio.run(run())
    # Each run: one call (required), its output sent back, then a final message.
    assert len(called) == 2
    for result in (blocking, streamed):
        assert isinstance(result.final_output, str)
        assert result.final_output
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
        assert kinds[-1] == "message_output_item"
    traces = served.recorder.enqueued()
    assert len(traces) == 4
    assert all(served.recorder.wait(t, "released") for t in traces)


def test_openai_agents_output_type(served: Served) -> None:
    import agents

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(
        name="facts",
        instructions="Answer with facts.",
        model=model,
        output_type=City,
        model_settings=agents.ModelSettings(max_tokens=120, temperature=0.0),
    )

    async def run() -> Any:
        async with client:
            return await agents.Runner.run(agent, "Paris has 2100000 people.")

    result = asyncio.run(run())
    assert isinstance(result.final_output, City)


# -- the openai SDK --------------------------------------------------------------------------


def test_a_streamed_function_call_parses(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert call.call_id
    assert json.loads("".join(deltas)) == json.loads(call.arguments)
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert call.status == "completed"
    assert final.status == "completed"


def test_a_named_tool_choice_and_the_call_output(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL,
        input="Weather in Lima?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        store=False,
    )
    [call] = first.output
    assert call.type == "function_call"
    second = client.responses.create(
        model=MODEL,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=24,
        store=False,
        input=[
            {"role": "user", "content": "Weather in Lima?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "cloudy, 18 C"},
        ],
    )
    assert second.output[0].type == "message"
    assert second.output_text


def test_an_output_for_no_call_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=MODEL,
            store=False,
            input=[
                {"role": "user", "content": "Weather in Lima?"},
                {"type": "function_call_output", "call_id": "call_9", "output": "cloudy"},
            ],
        )
    assert caught.value.param == "input"
    assert "no function_call before the function_call_output for call_id 'call_9'" in (
        caught.value.message
    )


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=MODEL,
        input="Tokyo has 14000000 people.",
        text_format=City,
        max_output_tokens=200,
        temperature=0,
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)


def test_previous_response_id_reuses_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=16)
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=8
    )
    assert second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_cancel_releases_within_a_step(served: Served, client: openai.OpenAI) -> None:
    got: list[str] = []
    with client.responses.stream(
        model=MODEL, input="Write a very long story.", max_output_tokens=2000
    ) as stream:
        for event in stream:
            got.append(event.type)
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta" and got.count(event.type) == 3:
                answer = plainhttp.post(
                    f"{served.url}/v1/responses/{response_id}/cancel", timeout=NET
                ).json()
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason.USER_CANCEL)
    assert answer["status"] == "cancelled"
    assert got[-1] == "response.incomplete"
    assert (
        sum(k in ("response.completed", "response.incomplete", "response.failed") for k in got) == 1
    )
    timeline = trace.to_dict()
    assert timeline["cancel_to_release_ms"] is not None
    # Released within one decode step of the cancel: fewer tokens after it than two steps.
    assert trace.completion_tokens <= got.count("response.output_text.delta") + 2


def test_cancel_a_background_response_on_the_model(served: Served) -> None:
    started = plainhttp.post(
        f"{served.url}/v1/responses",
        timeout=NET,
        json={
            "model": MODEL,
            "input": "Write a very long story.",
            "background": True,
            "max_output_tokens": 2000,
        },
    ).json()
    trace = served.recorder.nth(0)
    served.recorder.wait(trace, "first_token")
    answer = plainhttp.post(f"{served.url}/v1/responses/{started['id']}/cancel", timeout=NET).json()
    served.assert_released(trace, EndReason.USER_CANCEL)
    assert answer["status"] == "cancelled"
    url = f"{served.url}/v1/responses/{started['id']}"
    with plainhttp.stream("GET", url, params={"stream": "true"}, timeout=NET) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["tokenbelt"]["end_reason"] == "user_cancel"


# -- Codex -----------------------------------------------------------------------------------

#: tools as Codex CLI sends them (function tools; its built-in types are refused by name)
CODEX_TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "workdir": {"type": "string"},
                "timeout_ms": {"type": "number"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "update_plan",
        "description": "Updates the task plan.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"explanation": {"type": "string"}},
            "additionalProperties": False,
        },
    },
]


def _codex_turn(input_items: list[dict[str, Any]]) -> dict[str, Any]:
    """A request as Codex's published wire format has it: stateless, every turn whole."""
    instructions = "You are a coding agent running in a terminal. " + " ".join(
        f"Rule {i}: keep changes small, explain them, and run the tests." for i in range(40)
    )
    return {
        "model": MODEL,
        "instructions": instructions,
        "input": input_items,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": None,
        "store": False,
        "stream": True,
        "include": [],
        "prompt_cache_key": "0199a2b3-codex-session",
        "max_output_tokens": 24,
    }


def test_a_codex_shaped_second_turn_reports_cached_tokens(served: Served) -> None:
    user = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "List the files here."}],
    }
    events: list[list[dict[str, Any]]] = []
    transcript: list[dict[str, Any]] = [user]
    for turn in range(2):
        body = _codex_turn(transcript)
        body.pop("reasoning")  # Codex leaves it out for a model that does not reason
        with plainhttp.stream("POST", f"{served.url}/v1/responses", json=body, timeout=NET) as r:
            assert r.status_code == 200, r.read()
            events.append(
                [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
            )
        final = events[-1][-1]
        assert final["type"] in ("response.completed", "response.incomplete")
        transcript = [
            *transcript,
            *final["response"]["output"],
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": f"Thanks ({turn})."}],
            },
        ]
        for item in transcript:
            item.pop("status", None)
    first, second = (e[-1]["response"]["usage"] for e in events)
    assert first["input_tokens"] > 600
    assert second["input_tokens_details"]["cached_tokens"] >= first["input_tokens"] - 8


def test_codex_built_in_tools_are_left_out_and_named(served: Served) -> None:
    body = _codex_turn([{"role": "user", "content": "hi"}])
    body["tools"] = [*CODEX_TOOLS, {"type": "web_search"}]
    body["stream"] = False
    r = plainhttp.post(f"{served.url}/v1/responses", json=body, timeout=NET)
    assert r.status_code == 200, r.text
    assert r.json()["tokenbelt"]["skipped_tools"] == ["web_search"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_call_is_an_incomplete_function_call(served: Served, stream: bool) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "input": "Weather in Oslo?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
    }
    whole = plainhttp.post(f"{served.url}/v1/responses", json=body, timeout=NET).json()
    assert whole["output"][0]["type"] == "function_call"
    # Two tokens short of the whole call: cut inside its arguments.
    body.update(max_output_tokens=whole["usage"]["output_tokens"] - 2, stream=stream)
    if stream:
        with plainhttp.stream("POST", f"{served.url}/v1/responses", json=body, timeout=NET) as r:
            lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
        final = lines[-1]["response"]
        assert lines[-1]["type"] == "response.incomplete"
    else:
        final = plainhttp.post(f"{served.url}/v1/responses", json=body, timeout=NET).json()
    assert final["status"] == "incomplete"
    assert final["tokenbelt"]["tool_call_cut"] is True
    [call] = final["output"]
    assert call["type"] == "function_call"
    assert call["status"] == "incomplete"
    assert call["name"] == "get_weather"
    assert "<tool_call>" not in json.dumps(final["output"])
