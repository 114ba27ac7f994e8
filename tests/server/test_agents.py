"""An agent's requests on a server started with no flags: its first request fits, its
constant prefix (system prompt, tools, history) is read once, not at every turn, and
once per machine: a restart reads it back from disk instead of computing it again.

Agents send 6,000 to 23,000 tokens on their first request (Codex 6,473, Open WebUI
6,953), the same head at every turn; the context used to be 4,096 and the prefix cache
4,096 tokens, so the first request failed and every turn read its prompt again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import plainhttp
from serving import serve

NET = 500.0
#: the shared head, in tokens: Codex's constant part is about this long
SHARED = 6000


def _system_prompt() -> str:
    """About ``SHARED`` tokens of an agent's instructions and tool descriptions."""
    lines = [
        f"Tool {i}: reads the file data_{i}.txt in the workspace and reports how many "
        f"lines of it mention the word {word}."
        for i, word in zip(range(200), ["apple", "river", "stone", "cloud"] * 50, strict=True)
    ]
    return "You are a coding agent. You may call these tools.\n" + "\n".join(lines)


def _chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 8, "temperature": 0}
    answer = plainhttp.post(f"{url}/v1/chat/completions", json=body, timeout=NET)
    assert answer.status_code == 200, answer.text
    reply: dict[str, Any] = answer.json()
    return reply


@pytest.mark.timeout(600)  # one cold prefill of 6,000 tokens: about a minute on 2 cores
def test_an_agents_turns_read_their_shared_head_once_and_once_per_machine(
    tmp_path: Path,
) -> None:
    system = {"role": "system", "content": _system_prompt()}
    first = [system, {"role": "user", "content": "List the files."}]
    with serve(tmp_path, "smollm2-135m", timeout=NET) as (url, _):
        one = _chat(url, first)
        shared = one["usage"]["prompt_tokens"]
        assert shared > SHARED  # more than the old default context, served as it is
        said = one["choices"][0]["message"]["content"]
        later = [
            *first,
            {"role": "assistant", "content": said},
            {"role": "user", "content": "Go on."},
        ]
        two = _chat(url, later)
        assert two["usage"]["prompt_tokens"] > shared
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared - 8
    # A restart (the server stopped as a service manager stops it) reads the head back.
    with serve(tmp_path, "smollm2-135m", timeout=NET) as (url, _):
        again = _chat(url, first)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * shared
        assert again["choices"][0]["message"]["content"] == said  # the same cells: the same reply


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
