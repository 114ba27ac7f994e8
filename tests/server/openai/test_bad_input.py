"""Every bad input gets a 4xx with an OpenAI-style error, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import plainhttp
from tokenbelt import ScriptedEngine
from tokenbelt.server import ServerSettings

from ..conftest import (
    CHAT,
    COMPLETIONS,
    NET,
    Served,
    ServeFactory,
    chat_body,
    scripted_runtime,
    words,
)

CONTEXT = 16
LIMIT = 64 * 1024
TOO_LONG = " ".join(["word"] * (CONTEXT + 4))


@pytest.fixture
def served(serve: ServeFactory) -> Served:
    engine = ScriptedEngine(words(3), delay=0, context_length=CONTEXT)
    return serve(scripted_runtime(engine), ServerSettings(max_body_bytes=LIMIT))


#: (id, path, JSON body or raw bytes, status, error code, error param)
CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("unknown-model", CHAT, chat_body(model="nope"), 404, "model_not_found", "model"),
    ("chat-too-long", CHAT, chat_body(TOO_LONG), 400, "context_length_exceeded", None),
    ("prompt-too-long", COMPLETIONS, {"prompt": TOO_LONG}, 400, "context_length_exceeded", None),
    ("max-tokens-0", CHAT, chat_body(max_tokens=0), 400, "invalid_body", "max_tokens"),
    ("max-tokens-negative", CHAT, chat_body(max_tokens=-5), 400, "invalid_body", "max_tokens"),
    ("max-tokens-huge", CHAT, chat_body(max_tokens=10**12), 400, "invalid_body", "max_tokens"),
    ("max-tokens-text", CHAT, chat_body(max_tokens="ten"), 400, "invalid_body", "max_tokens"),
    (
        "max-completion-tokens-0",
        COMPLETIONS,
        {"prompt": "hi", "max_completion_tokens": 0},
        400,
        "invalid_body",
        "max_completion_tokens",
    ),
    ("truncated-json", CHAT, b'{"messages": [', 400, "invalid_json", None),
    ("not-json", CHAT, b"messages=hello", 400, "invalid_json", None),
    ("json-array", CHAT, b"[1, 2]", 400, "invalid_json", None),
    ("empty-body", CHAT, b"", 400, "invalid_json", None),
    ("messages-not-a-list", CHAT, {"messages": "hi"}, 400, "invalid_body", "messages"),
    ("missing-messages", CHAT, {"model": "scripted"}, 400, "invalid_body", "messages"),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 3}, 400, "invalid_body", "prompt"),
    ("empty-messages", CHAT, {"messages": []}, 400, "invalid_body", "messages"),
    (
        "unknown-role",
        CHAT,
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        "invalid_body",
        "messages.0.role",
    ),
    ("temperature-text", CHAT, chat_body(temperature="hot"), 400, "invalid_body", "temperature"),
    ("temperature-high", CHAT, chat_body(temperature=7), 400, "invalid_body", "temperature"),
    ("stream-not-bool", CHAT, chat_body(stream="please"), 400, "invalid_body", "stream"),
    # The schema is the behaviour: no string is read as a boolean or a number.
    ("stream-yes", CHAT, chat_body(stream="yes"), 400, "invalid_body", "stream"),
    ("stream-true-text", CHAT, chat_body(stream="true"), 400, "invalid_body", "stream"),
    ("max-tokens-digits", CHAT, chat_body(max_tokens="10"), 400, "invalid_body", "max_tokens"),
    ("temperature-digits", CHAT, chat_body(temperature="1"), 400, "invalid_body", "temperature"),
    ("seed-bool", CHAT, chat_body(seed=True), 400, "invalid_body", "seed"),
    ("n-0", CHAT, chat_body(n=0), 400, "invalid_body", "n"),
    ("n-too-many", CHAT, chat_body(n=17), 400, "invalid_body", "n"),
    ("empty-stop", CHAT, chat_body(stop=[""]), 400, "invalid_body", "stop.0"),
    ("empty-stop-string", CHAT, chat_body(stop=""), 400, "invalid_body", "stop"),
    ("two-prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "invalid_value", "prompt"),
    (
        "unknown-extension-key",
        CHAT,
        chat_body(tokenbelt={"bogus": 1}),
        400,
        "invalid_body",
        "tokenbelt.bogus",
    ),
    (
        "capacity-0",
        CHAT,
        chat_body(tokenbelt={"capacity": 0}),
        400,
        "invalid_body",
        "tokenbelt.capacity",
    ),
    (
        "negative-timeout",
        CHAT,
        chat_body(tokenbelt={"total_timeout": -1}),
        400,
        "invalid_body",
        "tokenbelt.total_timeout",
    ),
    (
        "declared-too-large",
        CHAT,
        json.dumps(chat_body("x" * (2 * LIMIT))).encode(),
        413,
        "body_too_large",
        None,
    ),
]


def assert_openai_error(
    response: httpx.Response, status: int, code: str | None, param: str | None
) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["code"] == code
    assert error["param"] == param


def assert_still_serving(served: Served) -> None:
    response = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(), timeout=NET)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "".join(words(3))


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_gets_an_openai_error(
    served: Served, path: str, body: Any, status: int, code: str | None, param: str | None
) -> None:
    url = f"{served.url}{path}"
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        response = plainhttp.post(url, content=body, headers=headers, timeout=NET)
    else:
        response = plainhttp.post(url, json=body, timeout=NET)
    assert_openai_error(response, status, code, param)
    assert_still_serving(served)


def test_unknown_model_lists_the_available_aliases(served: Served) -> None:
    response = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(model="nope"), timeout=NET)
    message = response.json()["error"]["message"]
    assert "nope" in message
    assert "available: scripted" in message


def test_a_catalog_alias_this_server_does_not_serve_says_how_to_serve_it(
    served: Served,
) -> None:
    body = chat_body(model="smollm2-135m")  # the built-in catalog's, not served here
    response = plainhttp.post(f"{served.url}{CHAT}", json=body, timeout=NET)
    assert_openai_error(response, 404, "model_not_found", "model")
    message = response.json()["error"]["message"]
    assert "is in this machine's catalog but this server does not serve it" in message
    assert "tokenbelt serve ... smollm2-135m" in message
    assert "available: scripted" in message


def test_a_chunked_body_over_the_limit_is_413(served: Served) -> None:
    def body() -> Iterator[bytes]:  # no Content-Length: the limit applies as it streams
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(4):
            yield b"x" * LIMIT
        yield b'"}]}'

    headers = {"content-type": "application/json"}
    response = plainhttp.post(f"{served.url}{CHAT}", content=body(), headers=headers, timeout=NET)
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert_openai_error(response, 413, "body_too_large", None)
    assert_still_serving(served)


def test_unknown_routes_and_methods_are_openai_errors(served: Served) -> None:
    missing = plainhttp.get(f"{served.url}/v1/nope", timeout=NET)
    assert_openai_error(missing, 404, "route_not_found", None)
    assert "GET /v1/nope" in missing.json()["error"]["message"]
    wrong = plainhttp.delete(f"{served.url}{CHAT}", timeout=NET)
    assert_openai_error(wrong, 405, "method_not_allowed", None)
    assert "DELETE" in wrong.json()["error"]["message"]
    assert "POST" in wrong.headers["allow"]
    assert_still_serving(served)


def test_a_transcription_where_no_speech_model_is_served_is_a_400_saying_how(
    served: Served,
) -> None:
    """The audio route on a chat-only server: one clear line naming ``model`` and the
    command that serves a speech model beside the chat one (it was a 500 where the
    multipart parser was not installed)."""
    answer = plainhttp.post(
        f"{served.url}/v1/audio/transcriptions",
        files={"file": ("a.wav", b"RIFF\x00\x00\x00\x00WAVE", "audio/wav")},
        data={"model": "whisper-1"},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "model"
    assert "no speech model is served here" in error["message"]
    assert "tokenbelt serve smollm2-135m whisper-tiny-en" in error["message"]
