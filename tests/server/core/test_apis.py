"""What the OpenAI, Ollama and Anthropic APIs share: metrics by api, the API key, error shapes,
the request id, the tokenbelt extension, and a disconnect that is ``client_disconnect``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import plainhttp
from tokenbelt import EndReason, ScriptedEngine
from tokenbelt.server import ServerSettings

from ..conftest import (
    CHAT,
    NET,
    RawClient,
    Served,
    ServeFactory,
    chat_body,
    scrape,
    scripted_runtime,
    value,
    words,
)

MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


def ollama_chat(**extra: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": USER, **extra}


def anthropic_message(**extra: Any) -> dict[str, Any]:
    return {"model": "scripted", "max_tokens": 5, "messages": USER, **extra}


@pytest.fixture
def served(serve: ServeFactory) -> Served:
    runtime = scripted_runtime(ScriptedEngine(words(100_000), delay=0.002))
    return serve(runtime)


def test_metrics_count_each_request_under_its_api(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        assert client.post(CHAT, json=chat_body(max_tokens=3)).status_code == 200
        ollama = client.post(
            "/api/chat", json=ollama_chat(stream=False, options={"num_predict": 4})
        )
        assert ollama.status_code == 200
        assert client.post(MESSAGES, json=anthropic_message(max_tokens=5)).status_code == 200
    hog = served.model().stream(prompt="in process", max_tokens=2)
    hog.read()
    for n in range(4):
        served.recorder.wait(served.recorder.nth(n), "released")

    samples = scrape(served)
    for api, tokens in (("openai", 3), ("ollama", 4), ("anthropic", 5), ("sdk", 2)):
        labels = {"model": "scripted", "api": api}
        assert value(samples, "tokenbelt_requests_total", end_reason="length", **labels) == 1
        assert value(samples, "tokenbelt_completion_tokens_total", **labels) == tokens
        assert value(samples, "tokenbelt_e2e_request_latency_seconds_count", **labels) == 1


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        (CHAT, chat_body(max_tokens=2), {"authorization": "Bearer sesame"}),
        (
            "/api/chat",
            ollama_chat(stream=False, options={"num_predict": 2}),
            {"authorization": "Bearer sesame"},
        ),
        (MESSAGES, anthropic_message(), {"x-api-key": "sesame"}),
        (MESSAGES, anthropic_message(), {"authorization": "Bearer sesame"}),
        (
            "/api/chat",
            ollama_chat(stream=False, options={"num_predict": 2}),
            {"x-api-key": "sesame"},
        ),
    ],
    ids=[
        "openai-bearer",
        "ollama-bearer",
        "anthropic-x-api-key",
        "anthropic-bearer",
        "ollama-x-api-key",
    ],
)
def test_the_api_key_is_taken_as_bearer_or_x_api_key(
    serve: ServeFactory, path: str, body: dict[str, Any], headers: dict[str, str]
) -> None:
    served = serve(
        scripted_runtime(ScriptedEngine(words(5), delay=0)),
        ServerSettings(api_key="sesame"),
    )
    ok = plainhttp.post(f"{served.url}{path}", json=body, headers=headers, timeout=NET)
    assert ok.status_code == 200, ok.text
    wrong = {k: v.replace("sesame", "open") for k, v in headers.items()}
    refused = plainhttp.post(f"{served.url}{path}", json=body, headers=wrong, timeout=NET)
    assert refused.status_code == 401
    assert served.recorder.events[-1].trace.request_id == ok.headers["x-request-id"]


def test_refusals_are_in_each_apis_error_shape(serve: ServeFactory) -> None:
    served = serve(
        scripted_runtime(ScriptedEngine(words(5), delay=0)),
        ServerSettings(api_key="sesame", max_body_bytes=2048),
    )
    key = {"authorization": "Bearer sesame"}
    big = "x" * 4096
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        # No key: refused by the middleware, before any route.
        assert client.get("/api/tags").json() == {
            "error": "a valid API key is required (Authorization: Bearer ... or x-api-key)"
        }
        anthropic = client.post(MESSAGES, json=anthropic_message())
        assert anthropic.status_code == 401
        assert anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "authentication_error"
        assert client.post(CHAT, json=chat_body()).json()["error"]["code"] == "invalid_api_key"

        # Too large a body.
        too_big = client.post("/api/chat", json=ollama_chat(big=big), headers=key)
        assert (too_big.status_code, set(too_big.json())) == (413, {"error"})
        too_big = client.post(MESSAGES, json=anthropic_message(big=big), headers=key)
        assert too_big.status_code == 413
        assert too_big.json()["error"]["type"] == "request_too_large"

        # A malformed body: 400 on both, as on OpenAI's routes.
        bad = client.post("/api/chat", json={"messages": "hi"}, headers=key)
        assert bad.status_code == 400
        assert bad.json()["error"].startswith("messages:")
        bad = client.post(MESSAGES, json={"model": "scripted", "messages": USER}, headers=key)
        assert bad.status_code == 400
        assert bad.json()["error"] == {
            "type": "invalid_request_error",
            "message": "max_tokens: Field required",
        }

        # An unknown field is named; an unknown route is Ollama's 404.
        unknown = client.post("/api/chat", json=ollama_chat(colour="blue"), headers=key)
        assert (unknown.status_code, unknown.json()) == (
            400,
            {"error": "colour: unsupported parameter"},
        )
        missing = client.post("/api/nothing", json={}, headers=key)
        assert missing.status_code == 404
        assert set(missing.json()) == {"error"}
        full = client.post("/api/chat", json=ollama_chat(model="nope"), headers=key)
        assert full.status_code == 404
        assert "nope" in full.json()["error"]
    assert served.recorder.events == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/chat", ollama_chat(options={"num_predict": 100_000})),
        (
            "/api/generate",
            {"model": "scripted", "prompt": "go", "options": {"num_predict": 100_000}},
        ),
        (MESSAGES, anthropic_message(max_tokens=100_000, stream=True)),
    ],
    ids=["ollama-chat", "ollama-generate", "anthropic"],
)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_client_that_leaves_is_client_disconnect(
    served: Served, path: str, body: dict[str, Any], stream: bool
) -> None:
    body = {**body, "stream": stream}
    with RawClient(served.url) as client:
        client.send(path, body)
        trace = served.recorder.nth(0)
        if stream:
            _, headers = client.read_head()
            assert headers["x-request-id"] == trace.request_id
            client.read_until(b"\n")
        served.recorder.wait(trace, "first_token")
    served.assert_released(trace, EndReason.CLIENT_DISCONNECT)
    assert 0 < trace.completion_tokens < 100_000


def test_the_tokenbelt_extension_sets_deadlines_and_capacity(served: Served) -> None:
    extension = {"total_timeout": 0.2, "capacity": 2}
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        ollama = client.post(
            "/api/chat",
            json=ollama_chat(stream=False, options={"num_predict": 100_000}, tokenbelt=extension),
        )
        assert ollama.status_code == 504
        assert ollama.json()["tokenbelt"]["end_reason"] == "total_timeout"
        with client.stream(
            "POST",
            MESSAGES,
            json=anthropic_message(max_tokens=100_000, stream=True, tokenbelt=extension),
        ) as anthropic:
            assert anthropic.headers["request-id"] == anthropic.headers["x-request-id"]
            lines = [line for line in anthropic.iter_lines() if line.startswith("data: ")]
    assert '"stop_reason":"max_tokens"' in lines[-2]  # Anthropic's own value for a cut reply
    assert '"end_reason":"total_timeout"' in lines[-2]
    for n in range(2):
        trace = served.recorder.nth(n)
        served.assert_released(trace, EndReason.TOTAL_TIMEOUT)
        assert 1 <= trace.buffer_peak <= 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_an_engine_failure_is_an_error_in_each_apis_shape(
    serve: ServeFactory, stream: bool
) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(10), delay=0, fail_after=2)))
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        ollama = client.post("/api/generate", json={"prompt": "go", "stream": stream})
        anthropic = client.post(MESSAGES, json=anthropic_message(stream=stream))
    for n in range(2):
        served.assert_released(served.recorder.nth(n), EndReason.RUNTIME_ERROR)
    if stream:
        # The failure is said in each dialect's way, and the stream still ends with its
        # dialect's own last event and the exact reason.
        *pieces, error, last = [json.loads(line) for line in ollama.text.splitlines()]
        assert [p["response"] for p in pieces] == words(2)
        assert "DecodeError" in error["error"]
        assert error["tokenbelt"]["end_reason"] == "runtime_error"
        assert (last["done"], last["done_reason"]) == (True, "runtime_error")
        assert last["tokenbelt"]["end_reason"] == "runtime_error"
        events = anthropic.text.rstrip().split("\n\n")
        assert [e.split("\n")[0] for e in events[-3:]] == [
            "event: error",
            "event: message_delta",
            "event: message_stop",
        ]
        assert '"type":"api_error"' in events[-3]
        assert '"stop_reason":"max_tokens"' in events[-2]
        assert '"end_reason":"runtime_error"' in events[-2]
    else:
        assert ollama.status_code == anthropic.status_code == 500
        assert "scripted failure" in ollama.json()["error"]
        assert anthropic.json()["error"]["type"] == "api_error"
        assert anthropic.json()["tokenbelt"]["end_reason"] == "runtime_error"


def test_streamed_and_whole_replies_hold_the_same_pieces(serve: ServeFactory) -> None:
    script = words(6)
    served = serve(scripted_runtime(ScriptedEngine(script, delay=0)))
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        whole = client.post("/api/chat", json=ollama_chat(stream=False)).json()
        assert whole["message"] == {"role": "assistant", "content": "".join(script)}
        assert (whole["done"], whole["done_reason"], whole["eval_count"]) == (True, "stop", 6)
        lines = client.post("/api/chat", json=ollama_chat()).text.splitlines()
        streamed = [json.loads(line) for line in lines]
        assert [s["message"]["content"] for s in streamed] == [*script, ""]
        generated = client.post("/api/generate", json={"prompt": "go"}).text.splitlines()
        assert [json.loads(line)["response"] for line in generated] == [*script, ""]

        message = client.post(MESSAGES, json=anthropic_message(max_tokens=100)).json()
        assert message["content"] == [{"type": "text", "text": "".join(script)}]
        assert (message["stop_reason"], message["usage"]["output_tokens"]) == ("end_turn", 6)
        events = client.post(MESSAGES, json=anthropic_message(max_tokens=100, stream=True)).text
    data = [
        json.loads(line[len("data: ") :])
        for line in events.splitlines()
        if line.startswith("data: ")
    ]
    deltas = [d["delta"]["text"] for d in data if d["type"] == "content_block_delta"]
    assert deltas == script
    assert data[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    # Anthropic's usage at the end: the whole split (nothing was read from a cache here).
    assert data[-2]["usage"] == {
        "input_tokens": message["usage"]["input_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 6,
    }
