"""A thinking model over HTTP: every dialect splits its reasoning from its answer, bounds
it (``tokenbelt.reasoning_budget``/``reasoning_timeout``, each dialect's own field), and
says so when a limit ended a request before its answer started.

The model is the default one with a Qwen3-style thinking template (``THINKING_TEMPLATE``):
its generation prompt opens ``<think>``, so every chat reply reasons first. Clients are
the real ``openai``, ``ollama`` and ``anthropic`` packages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tokenbelt import EndReason, Runtime
from tokenbelt.server import ServerSettings

from ..conftest import NET, Served, SharedServer, shared_server

pytestmark = pytest.mark.model

STORY: list[Any] = [
    {"role": "user", "content": "Write a long story about a dragon who learns to fly."}
]
GREEDY = {"temperature": 0.0}
#: the thinking model's name on the server (the GGUF file's stem)
MODEL = "smollm2-thinking"


def budget(tokens: int, **more: Any) -> dict[str, Any]:
    return {**GREEDY, "tokenbelt": {"reasoning_budget": tokens, **more}}


def thinking_runtime(path: Path) -> Runtime:
    runtime = Runtime(keep_alive=None)
    runtime.load(str(path))  # served as its file's stem
    return runtime


@pytest.fixture(scope="module")
def shared(module_home: Path, thinking_model: Path) -> Iterator[SharedServer]:
    with shared_server(lambda: thinking_runtime(thinking_model)) as server:
        yield server


@pytest.fixture(scope="module")
def bounded(module_home: Path, thinking_model: Path) -> Iterator[SharedServer]:
    """A server whose default reasoning budget is 8 tokens (``--reasoning-budget 8``):
    the dialects without a budget field of their own (Ollama's) are bounded by it."""
    settings = ServerSettings(reasoning_budget=8)
    with shared_server(lambda: thinking_runtime(thinking_model), settings) as server:
        yield server


@pytest.fixture
def bounded_served(bounded: SharedServer, request: pytest.FixtureRequest) -> Iterator[Served]:
    yield from bounded.view(request)


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET, max_retries=0) as c:
        yield c


# -- /v1/chat/completions --------------------------------------------------------------------


def test_a_reply_carries_its_reasoning_under_both_names(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=24, extra_body=budget(8)
    )
    message = reply.choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning_content"] == extra["reasoning"]
    assert extra["reasoning_content"].strip()
    assert message.content
    assert "think>" not in extra["reasoning_content"] + message.content
    assert reply.usage is not None
    details = reply.usage.completion_tokens_details
    assert details is not None
    assert details.reasoning_tokens == 8
    tokenbelt = (reply.model_extra or {})["tokenbelt"]
    assert (tokenbelt["ended_in"], tokenbelt["answer_started"]) == ("answer", True)
    assert tokenbelt["trace"]["reasoning"]["ended_by"] == "budget"


def test_streamed_deltas_give_the_reasoning_first_then_the_content(
    client: openai.OpenAI,
) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=24, stream=True, extra_body=budget(8)
    )
    parts: list[tuple[str, str]] = []
    with stream:
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                parts.append(("reasoning", extra["reasoning_content"]))
            if delta.content:
                parts.append(("content", delta.content))
    kinds = [kind for kind, _ in parts]
    assert kinds[0] == "reasoning"
    assert "content" in kinds
    # Once the answer started, no more reasoning.
    assert "reasoning" not in kinds[kinds.index("content") :]


def test_max_tokens_spent_in_reasoning_is_explained(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=6, extra_body=GREEDY
    )
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("length", "")
    assert (choice.message.model_extra or {})["reasoning_content"]
    tokenbelt = (reply.model_extra or {})["tokenbelt"]
    assert tokenbelt["end_reason"] == "length"
    assert (tokenbelt["ended_in"], tokenbelt["answer_started"]) == ("reasoning", False)
    assert "the answer never started" in tokenbelt["note"]
    assert tokenbelt["trace"]["reasoning"]["phase"] == "reasoning"


def test_a_stop_string_inside_the_reasoning_does_not_end_the_request(
    client: openai.OpenAI,
) -> None:
    free = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=20, extra_body=budget(10)
    )
    word = (free.choices[0].message.model_extra or {})["reasoning_content"].split()[1]
    stopped = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=20, stop=[word], extra_body=budget(10)
    )
    extra = stopped.choices[0].message.model_extra or {}
    assert word in extra["reasoning_content"]
    assert stopped.choices[0].message.content  # the answer came


def test_a_json_schema_answer_parses_although_thinking_came_first(
    client: openai.OpenAI,
) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a dragon, as JSON."}],
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "dragon", "schema": schema, "strict": True},
        },
        extra_body=budget(8),
    )
    message = reply.choices[0].message
    assert (message.model_extra or {})["reasoning_content"]
    assert isinstance(json.loads(message.content or "")["name"], str)


def test_reasoning_effort(client: openai.OpenAI) -> None:
    none = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=8, reasoning_effort="none", extra_body=GREEDY
    )
    assert "reasoning_content" not in (none.choices[0].message.model_extra or {})
    assert none.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=STORY, max_tokens=8, reasoning_effort="high"
        )
    assert refused.value.param == "reasoning_effort"
    assert "effort level" in str(refused.value)
    # The advice in this field's own values (it has no true or false).
    assert "leave it out or send 'none', not 'high'" in str(refused.value)


def test_a_thinking_deadline_starts_the_answer(client: openai.OpenAI, served: Served) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=STORY,
        max_tokens=120,
        extra_body={**GREEDY, "tokenbelt": {"reasoning_timeout": 0.3}},
    )
    trace = served.recorder.by_id(reply.id)
    assert trace.reasoning_ended_by == "deadline"
    assert reply.choices[0].message.content
    assert trace.reasoning_ended is not None
    assert trace.answer_started is not None  # through the worker's pipe too
    assert trace.answer_started >= trace.reasoning_ended


def test_a_disconnect_during_reasoning_releases_the_request(
    client: openai.OpenAI, served: Served
) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=2000, stream=True, extra_body=GREEDY
    )
    first = next(iter(stream))
    assert (first.choices[0].delta.model_extra or {})["reasoning_content"]
    stream.close()
    trace = served.recorder.by_id(first.id)
    served.assert_released(trace, EndReason.CLIENT_DISCONNECT)
    assert trace.phase == "reasoning"
    assert trace.completion_tokens < 2000


def test_a_cancel_during_reasoning_is_user_cancel(client: openai.OpenAI, served: Served) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=2000, stream=True, extra_body=GREEDY
    )
    with stream:
        first = next(iter(stream))
        trace = served.recorder.by_id(first.id)
        cancelled = client.post(f"/requests/{first.id}/cancel", cast_to=object, body={})
        assert cancelled == {"id": first.id, "cancelled": True, "end_reason": "user_cancel"}
        for _ in stream:
            pass
    served.assert_released(trace, EndReason.USER_CANCEL)
    assert trace.phase == "reasoning"


# -- /api/chat and /api/generate ----------------------------------------------------------------


@pytest.fixture
def ollama_client(bounded_served: Served) -> Iterator[ollama.Client]:
    transport = httpx.HTTPTransport()
    try:
        yield ollama.Client(host=bounded_served.url, timeout=NET, transport=transport)
    finally:
        transport.close()


def test_ollama_chat_returns_thinking_with_think_true(
    ollama_client: ollama.Client, bounded_served: Served
) -> None:
    reply = ollama_client.chat(
        MODEL, messages=STORY, think=True, options={"temperature": 0, "num_predict": 24}
    )
    trace = bounded_served.recorder.nth(0)
    assert (trace.reasoning_tokens, trace.reasoning_ended_by) == (8, "budget")  # the default
    assert reply.message.thinking
    assert reply.message.content
    assert "think>" not in reply.message.thinking + reply.message.content
    # The history goes back whole, its thinking too, for the next turn.
    history = [*STORY, reply.message, {"role": "user", "content": "And then?"}]
    again = ollama_client.chat(MODEL, messages=history, options={"num_predict": 4})
    assert again.done


def test_ollama_think_false_answers_at_once(ollama_client: ollama.Client) -> None:
    reply = ollama_client.chat(
        MODEL, messages=STORY, think=False, options={"temperature": 0, "num_predict": 8}
    )
    assert not reply.message.thinking
    assert reply.message.content


def test_ollama_streams_thinking_then_content(ollama_client: ollama.Client) -> None:
    parts: list[str] = []
    for chunk in ollama_client.chat(
        MODEL,
        messages=STORY,
        think=True,
        stream=True,
        options={"temperature": 0, "num_predict": 24},
    ):
        if chunk.message.thinking:
            parts.append("thinking")
        if chunk.message.content:
            parts.append("content")
    assert parts[0] == "thinking"
    assert "thinking" not in parts[parts.index("content") :]


def test_ollama_generate_returns_thinking(ollama_client: ollama.Client) -> None:
    reply = ollama_client.generate(
        MODEL, "Write a long story about a dragon.", think=True, options={"num_predict": 6}
    )
    assert reply.thinking
    assert (reply.response, reply.done_reason) == ("", "length")


def test_ollama_effort_levels_need_a_template_that_reads_them(
    ollama_client: ollama.Client, bounded_served: Served
) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        ollama_client.chat(MODEL, messages=STORY, think="high")
    assert refused.value.status_code == 400
    assert "think" in str(refused.value.error)
    assert "effort level" in str(refused.value.error)
    assert bounded_served.recorder.events == []


# -- /v1/messages --------------------------------------------------------------------------------


@pytest.fixture
def anthropic_client(served: Served) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=served.url, api_key="unused", timeout=NET, max_retries=0
    ) as c:
        yield c


ENABLED: Any = {"type": "enabled", "budget_tokens": 8}


def test_anthropic_thinking_blocks_come_first_with_the_budget(
    anthropic_client: anthropic.Anthropic, served: Served
) -> None:
    reply = anthropic_client.messages.create(
        model=MODEL, max_tokens=24, messages=STORY, thinking=ENABLED, extra_body=GREEDY
    )
    thinking, text = reply.content
    assert thinking.type == "thinking"
    assert thinking.thinking
    assert text.type == "text"
    assert text.text
    trace = served.recorder.by_id(reply.id)
    assert (trace.reasoning_tokens, trace.reasoning_ended_by) == (8, "budget")


@pytest.mark.parametrize(("effort", "budget"), [("low", 8), ("medium", 16)])
def test_anthropic_effort_is_the_reasoning_budget(
    anthropic_client: anthropic.Anthropic, served: Served, effort: str, budget: int
) -> None:
    """Claude Code's ``output_config.effort``: a share of ``max_tokens`` (low 1/8,
    medium 1/4) the model may spend reasoning before it answers."""
    reply = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=STORY,
        extra_body={**GREEDY, "output_config": {"effort": effort}},
    )
    trace = served.recorder.by_id(reply.id)
    assert (trace.reasoning_tokens, trace.reasoning_ended_by) == (budget, "budget")
    assert [block.type for block in reply.content] == ["thinking", "text"]
    said = reply.model_extra["tokenbelt"]["effort"] if reply.model_extra else None
    assert said == {"effort": effort, "applied": True, "reasoning_budget": budget}


def test_anthropic_streams_thinking_deltas_then_text(
    anthropic_client: anthropic.Anthropic,
) -> None:
    kinds: list[str] = []
    with anthropic_client.messages.stream(
        model=MODEL, max_tokens=24, messages=STORY, thinking=ENABLED, extra_body=GREEDY
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta"
    assert "text_delta" in kinds
    assert "thinking_delta" not in kinds[kinds.index("text_delta") :]
    assert [b.type for b in final.content] == ["thinking", "text"]
    # The turn goes back whole, its thinking block too.
    again = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[*STORY, {"role": "assistant", "content": final.content}, *STORY],
        thinking={"type": "disabled"},
    )
    assert again.stop_reason == "max_tokens"


def test_anthropic_max_tokens_inside_the_thinking_is_explained(
    anthropic_client: anthropic.Anthropic,
) -> None:
    reply = anthropic_client.messages.create(
        model=MODEL, max_tokens=6, messages=STORY, extra_body=GREEDY
    )
    assert reply.stop_reason == "max_tokens"
    assert [b.type for b in reply.content] == ["thinking"]
    tokenbelt = (reply.model_extra or {})["tokenbelt"]
    assert (tokenbelt["ended_in"], tokenbelt["answer_started"]) == ("reasoning", False)


# -- /v1/responses -------------------------------------------------------------------------------


def test_a_response_has_a_reasoning_item_then_its_message(
    client: openai.OpenAI, served: Served
) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Write a long story about a dragon.",
        max_output_tokens=24,
        extra_body=budget(8),
    )
    reasoning, message = response.output
    assert reasoning.type == "reasoning"
    assert reasoning.content
    assert reasoning.content[0].text
    assert message.type == "message"
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == 8
    # The output goes back as the next input, its reasoning item too.
    again = client.responses.create(
        model=MODEL,
        input=[
            *[item.model_dump(exclude_none=True) for item in response.output],
            {"role": "user", "content": "And then?"},
        ],
        max_output_tokens=4,
        reasoning={"effort": "none"},
    )
    assert [item.type for item in again.output] == ["message"]


def test_a_streamed_response_gives_reasoning_text_deltas_first(client: openai.OpenAI) -> None:
    kinds: list[str] = []
    with client.responses.stream(
        model=MODEL,
        input="Write a long story about a dragon.",
        max_output_tokens=24,
        extra_body=budget(8),
    ) as stream:
        for event in stream:
            if event.type.endswith(".delta"):
                kinds.append(event.type)
            if event.type == "response.incomplete":  # max_output_tokens, in the answer
                final = event.response
    assert kinds[0] == "response.reasoning_text.delta"
    assert "response.output_text.delta" in kinds
    assert "response.reasoning_text.delta" not in kinds[kinds.index("response.output_text.delta") :]
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_a_response_whose_answer_never_started_says_so(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Write a long story about a dragon.",
        max_output_tokens=6,
        extra_body=GREEDY,
    )
    assert response.status == "incomplete"
    assert [item.type for item in response.output] == ["reasoning"]
    tokenbelt = (response.model_extra or {})["tokenbelt"]
    assert (tokenbelt["ended_in"], tokenbelt["answer_started"]) == ("reasoning", False)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})
    assert refused.value.param == "reasoning.effort"


def test_ollama_show_lists_thinking_for_a_thinking_model(ollama_client: ollama.Client) -> None:
    shown = ollama_client.show(MODEL)
    assert "thinking" in (shown.capabilities or [])


def test_a_request_s_own_budget_wins_over_the_server_s(bounded_served: Served) -> None:
    with openai.OpenAI(
        base_url=f"{bounded_served.url}/v1", api_key="x", timeout=NET, max_retries=0
    ) as c:
        own = c.chat.completions.create(
            model=MODEL, messages=STORY, max_tokens=16, extra_body=budget(4)
        )
    assert bounded_served.recorder.by_id(own.id).reasoning_tokens == 4
    with anthropic.Anthropic(
        base_url=bounded_served.url, api_key="unused", timeout=NET, max_retries=0
    ) as a:
        dialect = a.messages.create(
            model=MODEL,
            max_tokens=16,
            messages=STORY,
            thinking={"type": "enabled", "budget_tokens": 5},
            extra_body=GREEDY,
        )
    assert bounded_served.recorder.by_id(dialect.id).reasoning_tokens == 5
