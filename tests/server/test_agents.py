"""An agent's requests on a server started with no flags: its first request fits, its
constant prefix (system prompt, tools, history) is read once, not at every turn, and
once per machine: a restart reads it back from disk instead of computing it again.

Agents send 6,000 to 23,000 tokens on their first request (Codex 6,473, Open WebUI
6,953), the same head at every turn; the context used to be 4,096 and the prefix cache
4,096 tokens, so the first request failed and every turn read its prompt again.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

import plainhttp
from serving import serve
from tokenbelt.cli._ps import table

NET = 500.0
#: the shared head of an agent's turns, in tokens: Codex's constant part is about this long
SHARED = 6000


#: Open WebUI 0.12.4's request on a new user's first message, recorded from its web page
#: with every setting at its default: 36 built-in tools, 6,952 prompt tokens
OPEN_WEBUI = json.loads(
    (Path(__file__).parent / "fixtures" / "open_webui_first_chat.json").read_text()
)


def _ollama_chat(
    client: httpx.Client, url: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reply of an Ollama chat (streamed, as sent) as a message, and its trace."""
    with client.stream("POST", f"{url}/api/chat", json=body) as answer:
        assert answer.status_code == 200, answer.read()
        lines = [json.loads(line) for line in answer.iter_lines() if line]
        request_id = answer.headers["x-request-id"]
    assert lines[-1]["done"] is True, lines[-1]
    text = "".join(x["message"].get("content", "") for x in lines)
    said: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [c for x in lines for c in x["message"].get("tool_calls", [])]
    if calls:
        said["tool_calls"] = calls
    trace: dict[str, Any] = client.get(f"{url}/v1/requests/{request_id}").json()
    return said, trace


@pytest.mark.timeout(900)  # one cold prefill of 6,952 tokens: about a minute on 2 cores
def test_open_webuis_first_chat_fits_and_its_tools_are_read_once_and_once_per_machine(
    tmp_path: Path,
) -> None:
    """Open WebUI's first request, replayed as recorded against a server started with
    no flags, is answered (it was a 400: 6,952 tokens, a 4,096 context); its next turn
    reads the shared head from the prefix cache; after a restart (as a service manager
    stops and starts it) the first request reads it back from disk, not by compute."""
    body = OPEN_WEBUI["body"]
    with (
        serve(tmp_path, "smollm2-135m", timeout=NET) as (url, _),
        httpx.Client(timeout=NET) as client,
    ):
        said, first = _ollama_chat(client, url, body)
        shared = first["prompt_tokens"]
        assert shared > SHARED  # more than the old default context, served as it is
        turn = {"role": "user", "content": "Go on."}
        _, second = _ollama_chat(client, url, {**body, "messages": [*body["messages"], said, turn]})
        assert second["prompt_tokens"] > shared
        assert second["cached_tokens"] >= shared - 8  # all of the first turn's prompt
    with (
        serve(tmp_path, "smollm2-135m", timeout=NET) as (url, _),
        httpx.Client(timeout=NET) as client,
    ):
        _, again = _ollama_chat(client, url, body)
        assert again["cached_tokens"] >= 0.9 * shared, again


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "TEXT"}]}),
        ("/v1/completions", {"prompt": "TEXT"}),
        ("/api/chat", {"messages": [{"role": "user", "content": "TEXT"}], "stream": False}),
        ("/api/generate", {"prompt": "TEXT", "stream": False}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "TEXT"}], "max_tokens": 8}),
        ("/v1/responses", {"input": "TEXT"}),
    ],
)
def test_a_prompt_past_the_context_names_the_context_the_trained_length_and_the_flag(
    short_server: str, path: str, body: dict[str, Any]
) -> None:
    text = " ".join(f"word{i}" for i in range(400))
    sent = {k: (text if v == "TEXT" else v) for k, v in body.items()}
    if "messages" in body:
        sent["messages"] = [{"role": "user", "content": text}]
    answer = plainhttp.post(
        f"{short_server}{path}", json={"model": "smollm2-135m", **sent}, timeout=NET
    )
    assert answer.status_code == 400, answer.text
    said = answer.text
    for words in ("256", "trained on 8192 tokens", "--n-ctx"):
        assert words in said, (path, said)


@pytest.fixture(scope="module")
def short_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("short")
    flags = ("--n-ctx", "256", "--slots", "1")
    with serve(tmp, "smollm2-135m", flags=flags, timeout=NET) as (url, _):
        yield url


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with serve(tmp_path_factory.mktemp("default"), "smollm2-135m", timeout=NET) as (url, _):
        yield url


def test_a_long_prompts_reading_shows_in_the_stream_the_requests_metrics_and_ps(
    default_server: str,
) -> None:
    """While a prompt of several steps is read, a streaming client that asks for it
    gets llama.cpp's ``prompt_progress`` chunks, ``/v1/requests`` holds how far the
    prefill has come, ``/metrics`` the tokens left, and ``tokenbelt ps`` says it."""
    url = default_server
    # new words: no prefix cache (in memory or on disk) holds them
    text = " ".join(f"line {i} of log {uuid.uuid4().hex[:8]} says the job ran." for i in range(40))
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "stream": True,
        "return_progress": True,
        "cache_prompt": False,
    }
    seen: list[dict[str, Any]] = []
    with (
        httpx.Client(timeout=NET) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        request_id = answer.headers["x-request-id"]
        chunks = []
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            if chunk.get("prompt_progress", {}).get("processed") and not seen:
                # mid-prefill: every other view says the same
                seen.append(client.get(f"{url}/v1/requests/{request_id}").json())
                seen.append({"metrics": client.get(f"{url}/metrics").text})
                health = client.get(f"{url}/health").json()
                listed = client.get(f"{url}/v1/requests").json()["data"]
                seen.append({"ps": table(health, listed)})  # what tokenbelt ps prints
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress, chunks[:3]
    assert progress[0]["processed"] == 0  # admitted, nothing read yet
    first = next(p for p in progress if p["processed"])
    assert 0 < first["processed"] < first["total"], progress
    assert first["time_ms"] > 0
    assert first["cache"] == 0
    assert chunks.index(next(c for c in chunks if "prompt_progress" in c)) == 0
    assert all(c["choices"] == [] for c in chunks if "prompt_progress" in c)
    assert any(c.get("choices") for c in chunks)  # then the reply, as always
    trace, metrics, ps = seen
    assert trace["prompt_tokens"] == first["total"]
    assert 0 < trace["prompt_read"] < trace["prompt_tokens"]
    left = re.search(
        r'tokenbelt_prefill_tokens_left\{model="smollm2-135m"\} (\S+)', metrics["metrics"]
    )
    assert left is not None
    assert float(left[1]) > 0
    assert re.search(rf"\b{trace['prompt_read']}/{trace['prompt_tokens']} tok\b", ps["ps"])
