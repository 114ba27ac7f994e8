"""Deadlines per request: a stream ends with a final chunk naming the reason, then [DONE];
a non-streaming request gets 504 with an OpenAI-style error whose code is the end reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

import plainhttp
from tokenbelt import EndReason, ScriptedEngine
from tokenbelt.server import ServerSettings

from ..conftest import (
    CHAT,
    COMPLETIONS,
    NET,
    Served,
    ServeFactory,
    StallingEngine,
    chat_body,
    collect,
    scripted_runtime,
    words,
)

#: reason -> (an engine that runs into it, the extension object that sets it)
CASES: dict[EndReason, tuple[Callable[[], Any], dict[str, float]]] = {
    EndReason.FIRST_TOKEN_TIMEOUT: (
        lambda: ScriptedEngine(words(5), prefill_delay=NET),
        {"first_token_timeout": 0.2},
    ),
    EndReason.TOTAL_TIMEOUT: (
        lambda: ScriptedEngine(words(100_000), delay=0.002),
        {"total_timeout": 0.5},
    ),
    EndReason.STALL_TIMEOUT: (
        lambda: StallingEngine(words(3)),
        {"stall_timeout": 0.2},
    ),
}


def streamed(served: Served, path: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    with plainhttp.stream("POST", f"{served.url}{path}", json=body, timeout=NET) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return response.headers["x-request-id"], collect(response.iter_lines())


def assert_stream_ended(events: list[Any], request_id: str, reason: EndReason) -> None:
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert all(e["id"] == request_id for e in events[:-1])
    assert final["choices"][0]["finish_reason"] == reason.openai_finish_reason
    assert final["tokenbelt"]["end_reason"] == reason.value
    trace = final["tokenbelt"]["trace"]
    assert trace["end_reason"] == reason.value
    assert trace["timeline_ms"]["released"] is not None


@pytest.mark.parametrize("reason", list(CASES), ids=[r.value for r in CASES])
def test_deadline_ends_a_stream_with_a_final_chunk(serve: ServeFactory, reason: EndReason) -> None:
    make, options = CASES[reason]
    served = serve(scripted_runtime(make()))
    request_id, events = streamed(
        served, CHAT, chat_body(stream=True, max_tokens=100_000, tokenbelt=options)
    )
    assert_stream_ended(events, request_id, reason)
    if reason is not EndReason.FIRST_TOKEN_TIMEOUT:
        assert len(events) > 3, "some content came before the deadline"
    served.assert_released(served.recorder.by_id(request_id), reason)


@pytest.mark.parametrize("reason", list(CASES), ids=[r.value for r in CASES])
def test_deadline_answers_504_when_not_streaming(serve: ServeFactory, reason: EndReason) -> None:
    make, options = CASES[reason]
    served = serve(scripted_runtime(make()))
    response = plainhttp.post(
        f"{served.url}{COMPLETIONS}",
        json={"prompt": "go", "max_tokens": 100_000, "tokenbelt": options},
        timeout=NET,
    )
    assert response.status_code == 504
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == reason.value
    assert reason.value in body["error"]["message"]
    assert body["tokenbelt"]["end_reason"] == reason.value
    trace = json.loads(response.headers["x-tokenbelt-trace"])
    assert trace["end_reason"] == reason.value
    assert trace["request_id"] == response.headers["x-request-id"]
    served.assert_released(served.recorder.by_id(response.headers["x-request-id"]), reason)


def test_server_default_deadlines_apply_without_the_extension(serve: ServeFactory) -> None:
    engine = ScriptedEngine(words(5), prefill_delay=NET)
    served = serve(scripted_runtime(engine), ServerSettings(first_token_timeout=0.2))
    request_id, events = streamed(served, CHAT, chat_body(stream=True))
    assert_stream_ended(events, request_id, EndReason.FIRST_TOKEN_TIMEOUT)


def test_a_request_can_extend_a_server_default(serve: ServeFactory) -> None:
    engine = ScriptedEngine(words(5), prefill_delay=0.3)
    served = serve(scripted_runtime(engine), ServerSettings(first_token_timeout=0.1))
    body = chat_body(tokenbelt={"first_token_timeout": NET})
    response = plainhttp.post(f"{served.url}{CHAT}", json=body, timeout=NET)
    assert response.status_code == 200
    assert response.json()["tokenbelt"]["end_reason"] == "stop"
