"""The Open Responses specification (openresponses.org): its compliance suite's seven
requests, written here from the spec, against the real model.

The suite validates every answer against the spec's ``ResponseResource`` schema: each
field below is required, with its type (a number is an int or a float; ``None`` where
the spec allows null). Sampling is the numbers used, never null; where tokenbelt has
one value for an option (no log probabilities here, one call a reply, one tier) the
answer says it. The image request is a clear 400: the default model has no vision.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import plainhttp
from tokenbelt.models import default_model_path

from ..conftest import NET, Served, SharedServer, real_runtime, shared_server

MODEL = default_model_path().stem
NUMBER = (int, float)
#: ``ResponseResource``'s required fields and their JSON types
REQUIRED: dict[str, tuple[type | None, ...]] = {
    "id": (str,),
    "object": (str,),
    "created_at": (int,),
    "completed_at": (int, None),
    "status": (str,),
    "incomplete_details": (dict, None),
    "model": (str,),
    "previous_response_id": (str, None),
    "instructions": (str, list, None),
    "output": (list,),
    "error": (dict, None),
    "tools": (list,),
    "tool_choice": (str, dict),
    "truncation": (str,),
    "parallel_tool_calls": (bool,),
    "text": (dict,),
    "top_p": NUMBER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "top_logprobs": (int,),
    "temperature": NUMBER,
    "reasoning": (dict, None),
    "user": (str, None),
    "usage": (dict, None),
    "max_output_tokens": (int, None),
    "max_tool_calls": (int, None),
    "store": (bool,),
    "background": (bool,),
    "service_tier": (str,),
    "metadata": (dict,),
    "safety_identifier": (str, None),
    "prompt_cache_key": (str, None),
}
#: the suite's tool (``tool-calling`` and ``tool-calling-streaming``)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {
                "type": "string",
                "description": "The city and state, e.g. San Francisco, CA",
            }
        },
        "required": ["location"],
    },
}
#: a 32x32 PNG (the suite's is a red heart; any image asks the same of the model)
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
    "z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


def _message(role: str, content: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content}


#: the suite's requests, by its test ids (``stream`` is added as the suite adds it)
REQUESTS: dict[str, dict[str, Any]] = {
    "basic-response": {"input": [_message("user", "Say hello in exactly 3 words.")]},
    "streaming-response": {"input": [_message("user", "Count from 1 to 5.")], "stream": True},
    "system-prompt": {
        "input": [
            _message("system", "You are a pirate. Always respond in pirate speak."),
            _message("user", "Say hello."),
        ]
    },
    "tool-calling": {
        "input": [_message("user", "What's the weather like in San Francisco?")],
        "tools": [WEATHER],
    },
    "tool-calling-streaming": {
        "input": [_message("user", "What's the weather like in San Francisco?")],
        "tools": [WEATHER],
        "stream": True,
    },
    "multi-turn": {
        "input": [
            _message("user", "My name is Alice."),
            _message("assistant", "Hello Alice! Nice to meet you. How can I help you today?"),
            _message("user", "What is my name?"),
        ]
    },
}


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    with shared_server(lambda: real_runtime(slots=2)) as server:
        yield server


def check_resource(response: dict[str, Any]) -> None:
    """``response`` holds every field ``ResponseResource`` requires, each of its type."""
    wrong = {}
    for name, kinds in REQUIRED.items():
        if name not in response:
            wrong[name] = "missing"
            continue
        value = response[name]
        allowed = tuple(k for k in kinds if k is not None)
        ok = (value is None and None in kinds) or (
            isinstance(value, allowed) and not (isinstance(value, bool) and bool not in kinds)
        )
        if not ok:
            wrong[name] = repr(value)
    assert wrong == {}, wrong
    assert response["object"] == "response"
    if response["usage"] is not None:
        usage = response["usage"]
        for key in ("input_tokens", "output_tokens", "total_tokens"):
            assert isinstance(usage[key], int)
        assert isinstance(usage["input_tokens_details"]["cached_tokens"], int)
        assert isinstance(usage["output_tokens_details"]["reasoning_tokens"], int)
    for item in response["output"]:
        assert isinstance(item["id"], str)
        assert item["status"] in ("in_progress", "completed", "incomplete")
        if item["type"] == "message":
            assert item["role"] == "assistant"
            for part in item["content"]:
                assert part["type"] == "output_text"
                assert isinstance(part["text"], str)
                assert part["annotations"] == []
        elif item["type"] == "function_call":
            assert all(isinstance(item[k], str) for k in ("call_id", "name", "arguments"))


def _ask(served: Served, test_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The suite's request ``test_id``: its final response, and its events if streamed."""
    # Greedy, so the small model answers the same every run (the suite sends no
    # sampling); and its tool requests call, as the suite checks, which with the
    # suite's choice (auto) is the small model's own to make.
    body = {"model": MODEL, **REQUESTS[test_id], "temperature": 0}
    if "tools" in body:
        body["tool_choice"] = "required"
    if not body.get("stream"):
        r = plainhttp.post(f"{served.url}/v1/responses", json=body, timeout=NET)
        assert r.status_code == 200, r.text
        return r.json(), []
    with plainhttp.stream("POST", f"{served.url}/v1/responses", json=body, timeout=NET) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[len("data: ") :]) for line in lines]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        if "response" in event:  # created, in_progress and the terminal event: whole
            check_resource(event["response"])
    assert events[-1]["type"] == "response.completed"
    return events[-1]["response"], events


@pytest.mark.parametrize("test_id", ["basic-response", "system-prompt", "multi-turn"])
def test_a_text_request_is_a_completed_response(served: Served, test_id: str) -> None:
    response, _ = _ask(served, test_id)
    check_resource(response)
    assert response["status"] == "completed"
    assert response["output"]


def test_the_streaming_request_streams_every_event_and_its_final_response(
    served: Served,
) -> None:
    response, events = _ask(served, "streaming-response")
    check_resource(response)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert response["status"] == "completed"


@pytest.mark.parametrize("test_id", ["tool-calling", "tool-calling-streaming"])
def test_the_tool_request_makes_a_function_call(served: Served, test_id: str) -> None:
    response, events = _ask(served, test_id)
    check_resource(response)
    assert any(item["type"] == "function_call" for item in response["output"])
    if events:
        kinds = [e["type"] for e in events]
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
        assert "function_call" in added
        assert "function_call" in done
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds


def test_the_image_request_is_a_clear_400(served: Served) -> None:
    content = [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": PNG},
    ]
    body = {"model": MODEL, "input": [_message("user", content)]}
    r = plainhttp.post(f"{served.url}/v1/responses", json=body, timeout=NET)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input.0.content.1"
    assert "no vision" in error["message"]


def test_sampling_is_echoed_as_the_numbers_used(served: Served) -> None:
    """Left out: the defaults used; sent: the values sent; the constants always."""
    base = {"model": MODEL, "input": "Hi.", "max_output_tokens": 2}
    default = plainhttp.post(f"{served.url}/v1/responses", json=base, timeout=NET).json()
    assert (default["temperature"], default["top_p"]) == (0.8, 0.95)
    assert (default["presence_penalty"], default["frequency_penalty"]) == (0.0, 0.0)
    sent = {
        "temperature": 0.2,
        "top_p": 0.5,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "max_tool_calls": 4,
        "service_tier": "flex",
        "safety_identifier": "user-7",
        "top_logprobs": 0,
    }
    echoed = plainhttp.post(f"{served.url}/v1/responses", json={**base, **sent}, timeout=NET)
    assert echoed.status_code == 200, echoed.text
    answer = echoed.json()
    check_resource(answer)
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        assert answer[key] == sent[key], key
    assert answer["safety_identifier"] == "user-7"
    # what tokenbelt does whatever was asked: one call a reply, one tier, no logprobs
    assert (answer["max_tool_calls"], answer["service_tier"], answer["top_logprobs"]) == (
        1,
        "default",
        0,
    )
