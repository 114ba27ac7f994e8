"""A stream with nothing to send for a while (a long prefill, a queue) writes a keepalive,
so clients whose HTTP stack gives up on a silent body keep waiting; the events are the
same with or without it."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

import plainhttp
from tokenbelt import ScriptedEngine
from tokenbelt.server import ServerSettings

from ..conftest import CHAT, NET, Served, ServeFactory, chat_body, scripted_runtime, words

#: a prefill long enough for several keepalives at KEEPALIVE_S
PREFILL_S = 0.6
KEEPALIVE_S = 0.1


@pytest.fixture
def served(serve: ServeFactory) -> Served:
    engine = ScriptedEngine(words(3), delay=0, prefill_delay=PREFILL_S)
    return serve(scripted_runtime(engine), ServerSettings(keepalive_s=KEEPALIVE_S))


def _lines(served: Served, path: str, body: dict[str, Any]) -> list[str]:
    with plainhttp.stream("POST", f"{served.url}{path}", json=body, timeout=NET) as r:
        assert r.status_code == 200
        return list(r.iter_lines())


def test_sse_streams_write_comments_while_the_prompt_is_read(served: Served) -> None:
    lines = _lines(served, CHAT, chat_body(stream=True))
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    keepalives = [line for line in lines[:first_data] if line == ": keepalive"]
    assert len(keepalives) >= 2
    assert lines[-2:] == ["data: [DONE]", ""]


def test_responses_and_the_openai_sdk_read_through_them(served: Served) -> None:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as client:
        with client.responses.stream(model="scripted", input="hi") as stream:
            final = stream.get_final_response()
        assert final.output_text == "".join(words(3))
        chunks = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(words(3))


def test_anthropic_streams_send_ping_events(served: Served) -> None:
    body = {
        "model": "scripted",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    lines = _lines(served, "/v1/messages", body)
    assert lines.count("event: ping") >= 2
    client = anthropic.Anthropic(base_url=served.url, api_key="x", timeout=NET)
    with client.messages.stream(
        model="scripted", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        assert stream.get_final_text() == "".join(words(3))
    client.close()


def test_ollama_streams_stay_one_json_object_a_line(served: Served) -> None:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    lines = [line for line in _lines(served, "/api/chat", body) if line]
    assert all(line.startswith("{") for line in lines)
