"""The OpenAPI document is the behaviour: what it calls valid is served, what it calls
invalid is a 400, never coerced (the fuzzer's "valid but rejected" and "invalid but
accepted" cases, each checked both ways against the live server)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

import plainhttp
from tokenbelt import ScriptedEngine

from .conftest import NET, Served, SharedServer, scripted_runtime, shared_server, words

SEA = [{"role": "user", "content": "Tell me about the sea."}]
CHAT = {"messages": SEA, "max_tokens": 3}
MESSAGES = {"model": "scripted", "messages": SEA, "max_tokens": 3}
OLLAMA = {"model": "scripted", "messages": SEA, "stream": False}
GENERATE = {"model": "scripted", "prompt": "hi", "stream": False}

#: (id, path, body, the field a 400 names; None: valid), as the document and the server
#: must both see it
CASES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("stop-empty-in-list", "/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
    ("stop-empty", "/v1/chat/completions", {**CHAT, "stop": ""}, "stop"),
    ("stop-word", "/v1/chat/completions", {**CHAT, "stop": ["x"]}, None),
    ("stream-yes", "/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("max-tokens-digits", "/v1/chat/completions", {**CHAT, "max_tokens": "10"}, "max_tokens"),
    ("max-tokens", "/v1/chat/completions", {**CHAT, "max_tokens": 10}, None),
    ("messages-top-k-text", "/v1/messages", {**MESSAGES, "top_k": "5"}, "top_k"),
    ("messages-top-k-fraction", "/v1/messages", {**MESSAGES, "top_k": 2.5}, "top_k"),
    ("messages-top-k-bool", "/v1/messages", {**MESSAGES, "top_k": True}, "top_k"),
    ("messages-top-k", "/v1/messages", {**MESSAGES, "top_k": 5}, None),
    ("ollama-format-list", "/api/chat", {**OLLAMA, "format": []}, "format"),
    ("ollama-format-none", "/api/chat", {**OLLAMA, "format": ""}, None),
    ("ollama-stream-text", "/api/chat", {**OLLAMA, "stream": "false"}, "stream"),
    ("ollama-height", "/api/generate", {**GENERATE, "height": 512}, "height"),
    ("ollama-height-null", "/api/generate", {**GENERATE, "height": None}, None),
    (
        "ollama-num-predict-text",
        "/api/chat",
        {**OLLAMA, "options": {"num_predict": "3"}},
        "num_predict",
    ),
]


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedServer]:
    engine = ScriptedEngine(words(3), delay=0)
    with shared_server(lambda: scripted_runtime(engine, queue_size=16)) as server:
        yield server


def _valid_per_document(document: dict[str, Any], path: str, body: dict[str, Any]) -> bool:
    content = document["paths"][path]["post"]["requestBody"]["content"]
    schema = {**content["application/json"]["schema"], "components": document["components"]}
    try:
        jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    ("path", "body", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_document_and_the_server_agree(
    served: Served, path: str, body: dict[str, Any], field: str | None
) -> None:
    document = plainhttp.get(f"{served.url}/openapi.json", timeout=NET).json()
    assert _valid_per_document(document, path, body) is (field is None)
    response = plainhttp.post(f"{served.url}{path}", json=body, timeout=NET)
    if field is None:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400, response.text
        assert field in response.text  # the error names the field at fault
