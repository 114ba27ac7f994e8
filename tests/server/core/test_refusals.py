"""Every refused request is counted: ``tokenbelt_refused_requests_total`` by route, status
and reason (the refused field, or the refusal's code), so an operator sees a client that
is turned away, whichever layer turned it away."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

import plainhttp
from tokenbelt import ScriptedEngine
from tokenbelt.server import ServerSettings

from ..conftest import CHAT, NET, Served, ServeFactory, chat_body, scripted_runtime

KEY = "sk-refusals"
AUTH = {"authorization": f"Bearer {KEY}"}
NAME = "tokenbelt_refused_requests_total"


@pytest.fixture
def served(serve: ServeFactory) -> Served:
    engine = ScriptedEngine.from_text("one two three", delay=0.0, context_length=64)
    return serve(scripted_runtime(engine), ServerSettings(api_key=KEY))


def refusals(served: Served) -> dict[tuple[str, str, str], float]:
    text = plainhttp.get(f"{served.url}/metrics", headers=AUTH, timeout=NET).text
    found: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == NAME:
                found[(s.labels["route"], s.labels["status"], s.labels["reason"])] = s.value
    return found


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "series"),
    [
        ("POST", CHAT, chat_body(temperature=7), AUTH, (CHAT, "400", "temperature")),
        ("POST", CHAT, chat_body(colour="blue"), AUTH, (CHAT, "400", "colour")),
        ("POST", CHAT, chat_body(), {}, (CHAT, "401", "invalid_api_key")),
        ("POST", CHAT, chat_body(model="nope"), AUTH, (CHAT, "404", "model_not_found")),
        (
            "POST",
            CHAT,
            chat_body(" ".join(["w"] * 80)),
            AUTH,
            (CHAT, "400", "context_length_exceeded"),
        ),
        ("POST", "/v1/nowhere", {}, AUTH, ("unmatched", "404", "route_not_found")),
        ("GET", CHAT, None, AUTH, (CHAT, "405", "method_not_allowed")),
        (
            "POST",
            "/api/embed",
            {"model": "scripted", "input": "x", "options": {"temperature": 1}},
            AUTH,
            ("/api/embed", "400", "options.temperature"),
        ),
        (
            "GET",
            "/v1/responses/resp_nope",
            None,
            AUTH,
            ("/v1/responses/{response_id}", "404", "response_not_found"),
        ),
        (
            "POST",
            "/api/chat",
            {"model": "scripted", "messages": [], "options": {"mirostat": 1}},
            AUTH,
            ("/api/chat", "400", "options.mirostat"),
        ),
    ],
)
def test_a_refused_request_is_counted_and_logged(
    served: Served,
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
    body: object,
    headers: dict[str, str],
    series: tuple[str, str, str],
) -> None:
    caplog.set_level(logging.INFO, logger="tokenbelt.requests")
    before = refusals(served).get(series, 0.0)
    answer = plainhttp.request(
        method, f"{served.url}{path}", json=body, headers=headers, timeout=NET
    )
    assert answer.status_code == int(series[1]), answer.text
    after = refusals(served)
    assert after.get(series, 0.0) == before + 1, after
    # One line says why, in the words the client was given, under the client's request id.
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tokenbelt.requests"]
    [line] = [x for x in lines if x["request_id"] == answer.headers["x-request-id"]]
    error = answer.json()["error"]
    assert line == {
        "event": "refused",
        "request_id": answer.headers["x-request-id"],
        "method": method,
        "route": series[0],
        "status": int(series[1]),
        "reason": series[2],
        "message": error if isinstance(error, str) else error["message"],
    }
    assert line["message"]


def test_an_answered_request_is_not_a_refusal(served: Served) -> None:
    before = refusals(served)
    answer = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(), headers=AUTH, timeout=NET)
    assert answer.status_code == 200
    assert refusals(served) == before


def test_head_of_the_root_answers_as_ollama_does(served: Served) -> None:
    """``HEAD /`` is how Ollama's CLI (and Claude Code) check that a server is there:
    answered 200 with no body, and no refusal counted."""
    before = refusals(served)
    answer = plainhttp.request("HEAD", f"{served.url}/", timeout=NET)
    assert answer.status_code == 200
    assert answer.content == b""
    assert refusals(served) == before
