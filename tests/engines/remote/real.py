"""What the remote engine's tests against real upstreams (vLLM, llama.cpp's llama-server)
share: a front over them, their requests, and the stops whose release each upstream must
show (``Real`` says how each one shows it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import plainhttp
from server.conftest import CHAT, NET, RawClient, Served, ServeFactory, collect
from tokenbelt import EndReason, Runtime, Trace

#: a long answer (with ``ignore_eos``, 1,500 tokens): an upstream that did not stop is busy
#: a while
COUNT = "Count from 1 to 1000, one number per line."


@dataclass(frozen=True)
class Real:
    """A real upstream: its URL, the model it serves, the kind the front finds, how the
    front confirms a release there (``release_by``) and its own count of requests at work."""

    url: str
    model: str
    kind: str
    release_by: str
    busy: Callable[[str], float]

    def body(self, content: str = "Say hi", **extra: Any) -> dict[str, Any]:
        return chat_body(self.model, content, **extra)


def chat_body(model: str, content: str = "Say hi", **extra: Any) -> dict[str, Any]:
    """A chat completion's body: one user message to ``model``."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def front(serve: ServeFactory, *urls: str, **options: Any) -> Served:
    """A tokenbelt server whose models are the upstreams' (``serve --upstream``)."""
    runtime = Runtime(keep_alive=None, queue_size=8)
    options.setdefault("health_interval", 0.5)
    runtime.add_upstreams(list(urls), **options)
    return serve(runtime)


def assert_confirmed(served: Served, trace: Trace, reason: EndReason, real: Real) -> None:
    """The front stopped ``trace`` for ``reason`` and saw the upstream let go after it."""
    served.assert_released(trace, reason)
    record = trace.to_dict()
    upstream = record["upstream"]
    assert upstream["url"] == real.url
    assert upstream["kind"] == real.kind
    assert upstream["release"] == "confirmed", upstream
    assert upstream["release_by"] == real.release_by
    stop = record["enqueued_at"] + record["timeline_ms"]["cancel_requested"] / 1000
    assert upstream["released_at"] >= stop - 0.01
    assert real.busy(real.url) == 0


def leave_a_stream(fr: Served, real: Real) -> None:
    """A streaming client leaves after three pieces: released and confirmed there."""
    with RawClient(fr.url) as client:
        client.send(CHAT, real.body(COUNT, ignore_eos=True, max_tokens=1500, stream=True))
        client.read_head()
        for _ in range(3):
            client.read_until(b'"content"')
        trace = fr.recorder.nth(0)
    assert_confirmed(fr, trace, EndReason.CLIENT_DISCONNECT, real)


def leave_unstreamed(fr: Served, real: Real) -> None:
    """A non-streaming client leaves once its request has a first token."""
    with RawClient(fr.url) as client:
        client.send(CHAT, real.body(COUNT, ignore_eos=True, max_tokens=1500))
        trace = fr.recorder.nth(0)
        fr.recorder.wait(trace, "first_token")
    assert_confirmed(fr, trace, EndReason.CLIENT_DISCONNECT, real)


def cancel_then_deadline(fr: Served, real: Real) -> None:
    """A user cancel mid-stream, then a total deadline: each released and confirmed."""
    long = real.body(COUNT, ignore_eos=True, max_tokens=1500, stream=True)
    with plainhttp.stream("POST", fr.url + CHAT, json=long, timeout=NET) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        next(line for line in lines if '"content"' in line)
        cancel = plainhttp.post(f"{fr.url}/v1/requests/{request_id}/cancel", timeout=NET)
        assert cancel.json()["cancelled"] is True
        events = collect(lines)
    assert events[-2]["tokenbelt"]["end_reason"] == "user_cancel"
    assert_confirmed(fr, fr.recorder.by_id(request_id), EndReason.USER_CANCEL, real)
    limited = {**long, "tokenbelt": {"total_timeout": 1.0}}
    with plainhttp.stream("POST", fr.url + CHAT, json=limited, timeout=NET) as response:
        request_id = response.headers["x-request-id"]
        events = collect(response.iter_lines())
    assert events[-2]["tokenbelt"]["end_reason"] == "total_timeout"
    assert_confirmed(fr, fr.recorder.by_id(request_id), EndReason.TOTAL_TIMEOUT, real)


#: a tool a schema test names, for any upstream
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def assert_schema_and_named_call(url: str, model: str, **sampling: Any) -> None:
    """Through the front at ``url``: a ``json_schema`` reply parses as ``PERSON``, and a
    named tool choice is a call of ``get_weather`` with a city (``sampling``: the rest of
    each request, e.g. ``max_tokens``)."""

    def ask(content: str, **extra: Any) -> dict[str, Any]:
        request = {"model": model, "messages": [{"role": "user", "content": content}]}
        answer = plainhttp.post(f"{url}{CHAT}", json=request | sampling | extra, timeout=NET)
        assert answer.status_code == 200, answer.text
        message: dict[str, Any] = answer.json()["choices"][0]["message"]
        return message

    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    person = json.loads(ask("Describe a person as JSON.", response_format=schema)["content"])
    assert isinstance(person["name"], str)
    assert isinstance(person["age"], int)
    named = {"type": "function", "function": {"name": "get_weather"}}
    (call,) = ask("Weather in Paris?", tools=[WEATHER], tool_choice=named)["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
