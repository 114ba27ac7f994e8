"""The fields vLLM- and llama.cpp-oriented clients send (benchmark tools among them), done
for real on the default model in a worker process, so each also crosses the pipe:
``ignore_eos``, ``min_tokens``, ``stream_options.continuous_usage_stats``,
``return_token_ids`` and ``cache_prompt``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import plainhttp
from tokenbelt.engines.llama import load_vocab
from tokenbelt.models import default_model_path

from ..conftest import NET, Served, SharedServer, real_runtime, shared_server

pytestmark = pytest.mark.model

MODEL = Path(default_model_path()).stem
# A question the default model answers in a few tokens, greedily.
SHORT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    with shared_server(lambda: real_runtime(isolation="process", slots=2)) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


@pytest.fixture(scope="module")
def detokenize() -> Iterator[Any]:
    vocab = load_vocab(default_model_path())

    def text(ids: list[int]) -> str:
        return bytes(vocab.detokenize(ids, special=False)).decode("utf-8")

    yield text
    vocab.close()


def chat(client: openai.OpenAI, max_tokens: int, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=SHORT, temperature=0, max_tokens=max_tokens, extra_body=extra
    )


def natural_length(client: openai.OpenAI) -> int:
    """How many tokens the greedy reply to ``SHORT`` has when it ends on its own."""
    reply = chat(client, 64)
    assert reply.choices[0].finish_reason == "stop"
    n: int = reply.usage.completion_tokens
    assert n < 40, "the short question must end well before the limits used here"
    return n


def test_ignore_eos_makes_exactly_max_tokens(client: openai.OpenAI) -> None:
    natural = natural_length(client)
    reply = chat(client, natural + 12, ignore_eos=True)
    assert reply.usage.completion_tokens == natural + 12
    assert reply.choices[0].finish_reason == "length"
    assert reply.tokenbelt["end_reason"] == "length"  # type: ignore[attr-defined]


def test_min_tokens_bans_the_end_until_reached(client: openai.OpenAI) -> None:
    natural = natural_length(client)
    reply = chat(client, 64, min_tokens=natural + 6)
    assert reply.usage.completion_tokens >= natural + 6
    assert reply.choices[0].finish_reason == "stop"  # reached, the end is allowed again


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
        ({"cache_prompt": "sometimes"}, "cache_prompt"),
        ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
        ({"stream_options": {"continuous_usage_stats": "often"}}, "stream_options"),
    ],
)
def test_bad_extras_are_400s_naming_them(served: Served, extra: dict[str, Any], param: str) -> None:
    body = {"messages": SHORT, "max_tokens": 4, **extra}
    answer = plainhttp.post(f"{served.url}/v1/chat/completions", json=body, timeout=NET)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"].startswith(param), answer.text


def test_cache_prompt_true_reuses_the_prefix_and_false_computes_it_all(
    client: openai.OpenAI,
) -> None:
    chat(client, 4, cache_prompt=True)
    again = chat(client, 4, cache_prompt=True)  # what the server does anyway
    assert again.tokenbelt["trace"]["cached_tokens"] > 0  # type: ignore[attr-defined]
    cold = chat(client, 4, cache_prompt=False)
    assert cold.tokenbelt["trace"]["cached_tokens"] == 0  # type: ignore[attr-defined]
    assert cold.usage.prompt_tokens == again.usage.prompt_tokens


def test_continuous_usage_is_on_every_chunk_and_adds_up(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=SHORT,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    final = chunks[-1]
    assert not final.choices
    assert final.usage is not None
    assert with_choices
    assert all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts)  # never goes back
    assert counts[-1] == final.usage.completion_tokens
    for c in with_choices:
        assert c.usage.prompt_tokens == final.usage.prompt_tokens
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text
    assert counts[-1] >= 1


def test_return_token_ids_decode_back_to_the_text(client: openai.OpenAI, detokenize: Any) -> None:
    reply = chat(client, 16, return_token_ids=True)
    data = reply.model_dump()
    ids = data["choices"][0]["token_ids"]
    assert len(ids) == reply.usage.completion_tokens
    assert detokenize(ids) == reply.choices[0].message.content
    prompt_ids = data["prompt_token_ids"]
    assert len(prompt_ids) == reply.usage.prompt_tokens
    assert "Say hi." in detokenize(prompt_ids)
    # Not asked for: not there.
    assert "token_ids" not in chat(client, 4).model_dump()["choices"][0]


def test_return_token_ids_streamed_completion(served: Served, detokenize: Any) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    chunks = []
    with plainhttp.stream("POST", f"{served.url}/v1/completions", json=body, timeout=NET) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "prompt_token_ids" in choices[0]
    assert all("prompt_token_ids" not in c for c in choices[1:])  # once, on the first
    assert detokenize(choices[0]["prompt_token_ids"]) == "Once upon a time"
    ids = [t for c in choices for t in c["token_ids"]]
    assert len(ids) == chunks[-1]["usage"]["completion_tokens"] == 10
    assert detokenize(ids) == "".join(c["text"] for c in choices)
