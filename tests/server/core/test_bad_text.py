"""Text that cannot be served is a 400 in the API's own shape, never a 500 or a crash.

A lone UTF-16 surrogate (JSON ``"\\ud800"``) cannot be encoded for the tokenizer;
it used to be a 500 ``text/plain`` with a traceback. An empty completion prompt has
no token to start from; it used to be a 500 ``AssertionError``, and on the batch
engine it hung the request and then corrupted native memory. Both are refused
before admission (no trace), in every API, and the SDK refuses them the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import plainhttp
from tokenbelt import InvalidArgument

from ..conftest import (
    CHAT,
    COMPLETIONS,
    NET,
    Served,
    SharedServer,
    real_runtime,
    shared_server,
)

#: (id, path, raw JSON body, what the message names)
CASES = [
    (
        "chat-content",
        CHAT,
        rb'{"messages":[{"role":"user","content":"a\ud800b"}],"max_tokens":2}',
        "message content is not valid Unicode: a lone surrogate '\\ud800' at position 1",
    ),
    (
        "completion-prompt",
        COMPLETIONS,
        rb'{"prompt":"\udfff","max_tokens":2}',
        "prompt is not valid Unicode: a lone surrogate '\\udfff' at position 0",
    ),
    (
        "stop",
        CHAT,
        rb'{"messages":[{"role":"user","content":"hi"}],"stop":["\udc00"],"max_tokens":2}',
        "stop is not valid Unicode",
    ),
    ("empty-prompt", COMPLETIONS, rb'{"prompt":"","max_tokens":2}', "prompt is empty"),
    ("empty-prompt-list", COMPLETIONS, rb'{"prompt":[""],"max_tokens":2}', "prompt is empty"),
]


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    """One server for the module: its tests only send requests and read their own traces."""
    with shared_server(lambda: real_runtime(n_ctx=512)) as server:
        yield server


def _post(served: Served, path: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return plainhttp.post(f"{served.url}{path}", content=body, headers=headers, timeout=NET)


@pytest.mark.model
@pytest.mark.parametrize(
    ("path", "body", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_openai_routes_answer_400(served: Served, path: str, body: bytes, message: str) -> None:
    response = _post(served, path, body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_value"
    assert message in error["message"]
    assert served.recorder.events == []  # refused before admission
    # ...and the server still serves.
    ok = _post(served, CHAT, b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}')
    assert ok.status_code == 200


@pytest.mark.model
def test_ollama_and_anthropic_routes_answer_400_in_their_shapes(served: Served) -> None:
    name = served.model().name.encode()
    ollama = _post(
        served,
        "/api/chat",
        b'{"model":"' + name + rb'","messages":[{"role":"user","content":"\ud800"}],'
        b'"stream":false}',
    )
    assert ollama.status_code == 400
    assert "not valid Unicode" in ollama.json()["error"]
    anthropic = _post(
        served,
        "/v1/messages",
        b'{"model":"' + name + rb'","max_tokens":2,"system":"\udfff",'
        b'"messages":[{"role":"user","content":"a"}]}',
    )
    assert anthropic.status_code == 400
    body = anthropic.json()
    assert body["type"] == "error"
    assert "not valid Unicode" in body["error"]["message"]


@pytest.mark.model
def test_the_sdk_refuses_the_same_text(served: Served) -> None:
    model = served.model()
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        model.stream(prompt="")
    with pytest.raises(InvalidArgument, match="not valid Unicode"):
        model.stream("a\ud800b")
    with pytest.raises(InvalidArgument, match="not valid Unicode"):
        model.chat().stream("\udfff")
