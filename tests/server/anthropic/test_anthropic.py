"""The official ``anthropic`` SDK, unchanged, against the real default model: messages.create
and messages.stream, tools, count_tokens, stop sequences, Anthropic-shaped errors, and
leaving a stream early."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

import plainhttp
from tokenbelt import EndReason, GenerationRequest

from ..conftest import (
    NET,
    Served,
    ServeFactory,
    SharedServer,
    StallingEngine,
    collect,
    real_runtime,
    scripted_runtime,
    shared_server,
)

pytestmark = pytest.mark.model

SEA: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
# Newer SDKs dropped ``temperature`` from their signatures; the API still takes it.
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    """One server for the module: its tests only send requests and read their own traces."""
    with shared_server(real_runtime) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=served.url, api_key="unused", timeout=NET, max_retries=0
    ) as c:
        yield c


def name(served: Served) -> str:
    return served.model().name


def prompt_of(usage: anthropic.types.Usage) -> int:
    """The whole prompt: what was computed and what the cache gave."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def assert_usage(usage: anthropic.types.Usage, trace: Any) -> None:
    """Anthropic's meaning: ``input_tokens`` is the part not read from the cache."""
    assert usage.cache_read_input_tokens == trace.cached_tokens
    assert usage.input_tokens == trace.prompt_tokens - trace.cached_tokens
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens == trace.completion_tokens


def text_of(message: anthropic.types.Message) -> str:
    (block,) = message.content
    assert block.type == "text"
    return block.text


def test_messages_create(client: anthropic.Anthropic, served: Served) -> None:
    reply = client.messages.create(
        model=name(served), max_tokens=12, messages=SEA, extra_body=GREEDY
    )
    trace = served.recorder.nth(0)
    served.assert_released(trace, trace.end_reason or EndReason.RUNTIME_ERROR)
    assert reply.id == trace.request_id
    assert reply.type == "message"
    assert reply.role == "assistant"
    assert reply.model == name(served)
    assert text_of(reply)
    expected = {EndReason.STOP: "end_turn", EndReason.LENGTH: "max_tokens"}
    assert reply.stop_reason == expected[trace.end_reason or EndReason.RUNTIME_ERROR]
    assert reply.stop_sequence is None
    assert_usage(reply.usage, trace)
    assert trace.prompt_tokens > 0
    assert 0 < reply.usage.output_tokens <= 12


def test_system_as_a_string_or_as_text_blocks(client: anthropic.Anthropic, served: Served) -> None:
    system = "You are a sailor. Answer in one sentence."
    as_string = client.messages.create(
        model=name(served), max_tokens=16, messages=SEA, extra_body=GREEDY, system=system
    )
    as_blocks = client.messages.create(
        model=name(served),
        max_tokens=16,
        messages=SEA,
        extra_body=GREEDY,
        system=[
            {"type": "text", "text": system[:10]},
            {"type": "text", "text": system[10:], "cache_control": {"type": "ephemeral"}},
        ],
    )
    # The same conversation through the OpenAI API, with the system prompt as a message.
    openai_style = plainhttp.post(
        f"{served.url}/v1/chat/completions",
        json={
            "model": name(served),
            "messages": [{"role": "system", "content": system}, *SEA],
            "max_tokens": 16,
            **GREEDY,
        },
        timeout=NET,
    ).json()
    # The same prompt three ways: the system text reached the template whole each time.
    assert prompt_of(as_blocks.usage) == prompt_of(as_string.usage)
    assert prompt_of(as_string.usage) == openai_style["usage"]["prompt_tokens"]
    assert text_of(as_string)
    assert text_of(as_blocks)


def test_messages_stream(client: anthropic.Anthropic, served: Served) -> None:
    with client.messages.stream(
        model=name(served), max_tokens=24, messages=SEA, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "text"]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert len(deltas) > 1
    assert "".join(deltas) == text_of(final)
    trace = served.recorder.nth(0)
    served.assert_released(trace, trace.end_reason or EndReason.RUNTIME_ERROR)
    assert final.id == trace.request_id
    assert final.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[trace.end_reason or ""]
    assert_usage(final.usage, trace)


def test_a_stop_sequence_ends_the_message(client: anthropic.Anthropic, served: Served) -> None:
    # Every reply of this model to this question starts by naming the sea.
    stops = ["Paris", " sea"]
    reply = client.messages.create(
        model=name(served), max_tokens=64, messages=SEA, extra_body=GREEDY, stop_sequences=stops
    )
    assert reply.stop_reason == "stop_sequence"
    assert reply.stop_sequence == " sea"
    assert " sea" not in text_of(reply)
    assert reply.usage.output_tokens < 64

    with client.messages.stream(
        model=name(served), max_tokens=64, messages=SEA, extra_body=GREEDY, stop_sequences=stops
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", " sea")
    assert " sea" not in text_of(final)
    assert served.recorder.nth(1).stop_sequence == " sea"


def test_max_tokens_is_required(client: anthropic.Anthropic, served: Served) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=name(served),
            messages=SEA,
            max_tokens=anthropic.NOT_GIVEN,  # type: ignore[arg-type]
        )
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    assert served.recorder.events == []


@pytest.mark.parametrize(
    ("change", "status", "kind", "named"),
    [
        ({"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            None,
            "messages[0].content[0].type",
        ),
        ({"messages": [*SEA, {"role": "assistant", "content": " "}]}, 400, None, "messages[1]"),
        ({"extra_body": {"temperature": 1.5}}, 400, None, "temperature"),
    ],
    ids=["unknown-model", "image-block", "empty-prefill", "temperature"],
)
def test_errors_have_anthropics_shape(
    client: anthropic.Anthropic,
    served: Served,
    change: dict[str, Any],
    status: int,
    kind: str | None,
    named: str,
) -> None:
    params: dict[str, Any] = {"model": name(served), "max_tokens": 8, "messages": SEA, **change}
    with pytest.raises(anthropic.APIStatusError) as refused:
        client.messages.create(**params)
    assert refused.value.status_code == status
    body = refused.value.body
    assert isinstance(body, dict)
    assert set(body) == {"type", "error"}
    assert body["error"]["type"] == (kind or "invalid_request_error")
    assert named in body["error"]["message"]
    assert served.recorder.events == []


def test_closing_the_stream_early_is_client_disconnect(
    client: anthropic.Anthropic, served: Served
) -> None:
    with client.messages.stream(
        model=name(served), max_tokens=2000, messages=SEA, extra_body=GREEDY
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break
        request_id = stream.response.headers["x-request-id"]
    trace = served.recorder.by_id(request_id)
    served.assert_released(trace, EndReason.CLIENT_DISCONNECT)
    assert 0 < trace.completion_tokens < 2000
    record = plainhttp.get(f"{served.url}/v1/requests/{request_id}", timeout=NET).json()
    assert record["end_reason"] == "client_disconnect"


def test_a_cancelled_stream_says_so_in_message_delta(
    client: anthropic.Anthropic, served: Served
) -> None:
    with client.messages.stream(
        model=name(served), max_tokens=2000, messages=SEA, extra_body=GREEDY
    ) as stream:
        request_id = stream.response.headers["x-request-id"]
        cancelled = False
        for event in stream:
            if event.type == "content_block_delta" and not cancelled:
                cancel = f"{served.url}/v1/requests/{request_id}/cancel"
                assert plainhttp.post(cancel, timeout=NET).json()["cancelled"] is True
                cancelled = True
            if event.type == "message_delta":
                # Anthropic's own value for an end the caller chose; the exact one beside it.
                assert event.delta.stop_reason == "end_turn"
                extension = event.model_extra or {}
                assert extension["tokenbelt"]["end_reason"] == "user_cancel"
        final = stream.get_final_message()
    assert final.usage.output_tokens == served.recorder.by_id(request_id).completion_tokens
    served.assert_released(served.recorder.by_id(request_id), EndReason.USER_CANCEL)


def test_a_deadline_is_max_tokens_with_the_exact_reason_beside_it(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(StallingEngine([" a", " b"])))
    body = {
        "model": "scripted",
        "max_tokens": 100,
        "messages": SEA,
        "stream": True,
        "tokenbelt": {"stall_timeout": 0.2},
    }
    with plainhttp.stream("POST", f"{served.url}/v1/messages", json=body, timeout=NET) as answer:
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    (delta,) = [json.loads(x[6:]) for x in lines if '"message_delta"' in x]
    assert delta["delta"]["stop_reason"] == "max_tokens"  # cut short: not a finished turn
    assert delta["tokenbelt"]["end_reason"] == "stall_timeout"


WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 32},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
ANY: Any = {"type": "any"}


def test_tool_choice_any_gives_a_tool_use_block(
    client: anthropic.Anthropic, served: Served
) -> None:
    reply = client.messages.create(
        model=name(served), max_tokens=64, messages=ASK, tools=[WEATHER], tool_choice=ANY
    )
    assert reply.stop_reason == "tool_use"
    (block,) = reply.content
    assert block.type == "tool_use"
    assert block.name == "get_weather"
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])

    # As the AI SDK's Anthropic provider streams a tool: eager_input_streaming on it.
    eager = {**WEATHER, "eager_input_streaming": True, "strict": True}
    with client.messages.stream(
        model=name(served), max_tokens=64, messages=ASK, tools=[eager], tool_choice=ANY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["tool_use"]
    partial = [
        e.delta.partial_json  # type: ignore[union-attr]
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(partial) > 1
    (used,) = final.content
    assert used.type == "tool_use"
    assert json.loads("".join(partial)) == used.input
    jsonschema.validate(used.input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use"
    with pytest.raises(anthropic.BadRequestError, match=r"tools\[0\]\.strict"):
        client.messages.create(
            model=name(served), max_tokens=8, messages=ASK, tools=[{**WEATHER, "strict": "yes"}]
        )


PERSON_TOOL = {
    "name": "P",
    "description": "person",
    "input_schema": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
}


def test_a_tool_call_cut_by_max_tokens_is_a_max_tokens_message(served: Served) -> None:
    """A forced call whose arguments the limit cuts off: a 200 that says max_tokens, its
    tool_use block's input empty (as the SDK makes of the same reply streamed); it was a
    plain-text 500, which the SDK retried."""
    body = {
        "model": name(served),
        "max_tokens": 28,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Bob is 30."}],
        "tools": [PERSON_TOOL],
        "tool_choice": {"type": "tool", "name": "P"},
    }
    r = httpx.post(f"{served.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["stop_reason"] == "max_tokens"
    assert [b["type"] for b in reply["content"]] == ["tool_use"]
    assert reply["content"][0]["input"] == {}


def test_a_tool_result_gets_a_text_answer(client: anthropic.Anthropic, served: Served) -> None:
    called = {
        "type": "tool_use",
        "id": "toolu_1",
        "name": "get_weather",
        "input": {"city": "Paris", "unit": "celsius"},
    }
    for result in (
        "Sunny, 24 C",
        [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "24 C"}],
    ):
        messages: Any = [
            *ASK,
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, called]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}],
            },
        ]
        reply = client.messages.create(
            model=name(served), max_tokens=24, messages=messages, tools=[WEATHER], extra_body=GREEDY
        )
        assert text_of(reply)
        assert reply.stop_reason in ("end_turn", "max_tokens")
    # The two ways to send the result are the same prompt.
    assert served.recorder.nth(0).prompt_tokens == served.recorder.nth(1).prompt_tokens
    failed: Any = [
        *messages[:2],
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "no such city",
                    "is_error": True,
                }
            ],
        },
    ]
    assert text_of(
        client.messages.create(model=name(served), max_tokens=8, messages=failed, extra_body=GREEDY)
    )


def test_a_tool_result_that_answers_no_tool_use_is_a_400(
    client: anthropic.Anthropic, served: Served
) -> None:
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}
    other = {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}
    for before in ([], [{"role": "assistant", "content": [other]}]):
        messages: Any = [*ASK, *before, {"role": "user", "content": [result]}]
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=name(served), max_tokens=4, messages=messages)
        assert "tool_use_id 'toolu_1', which no tool_use block" in caught.value.message
        assert f"messages[{len(messages) - 1}]" in caught.value.message
    assert not served.recorder.enqueued()


def test_the_anthropic_sdk_lists_and_retrieves_models(
    client: anthropic.Anthropic, served: Served
) -> None:
    listed = client.models.list()
    assert [m.id for m in listed.data] == [name(served)]
    (model,) = listed.data
    assert (model.type, model.display_name) == ("model", name(served))
    assert model.created_at.year == 1970
    assert (listed.first_id, listed.last_id, listed.has_more) == (model.id, model.id, False)
    assert client.models.retrieve(name(served)).display_name == name(served)


def test_a_text_document_is_read_as_its_title_and_text(
    client: anthropic.Anthropic, served: Served
) -> None:
    data = base64.b64encode(b"milk, eggs").decode()
    sources = [
        {"type": "text", "media_type": "text/plain", "data": "milk, eggs"},
        {"type": "base64", "media_type": "text/plain", "data": data},
    ]
    said = [{"role": "user", "content": "notes\nmilk, eggs\n\nSummarize it."}]
    expected = client.messages.count_tokens(model=name(served), messages=said).input_tokens  # type: ignore[arg-type]
    for source in sources:
        document = {"type": "document", "title": "notes", "source": source}
        asked: Any = [
            {"role": "user", "content": [document, {"type": "text", "text": "Summarize it."}]}
        ]
        counted = client.messages.count_tokens(model=name(served), messages=asked)
        assert counted.input_tokens == expected
    pdf = {"type": "base64", "media_type": "application/pdf", "data": data}
    for block, says in (
        ({"type": "document", "source": pdf}, "extract a PDF's or a document's text first"),
        ({"type": "document", "source": {"type": "url", "url": "https://x"}}, "fetches no URL"),
        (
            {"type": "document", "source": sources[0], "citations": {"enabled": True}},
            "cites no sources",
        ),
    ):
        with pytest.raises(anthropic.BadRequestError, match=says):
            client.messages.create(
                model=name(served),
                max_tokens=4,
                messages=[{"role": "user", "content": [block]}],  # type: ignore[list-item]
            )


def test_count_tokens_is_the_requests_input_tokens(
    client: anthropic.Anthropic, served: Served
) -> None:
    asks: list[dict[str, Any]] = [
        {"messages": SEA},
        {"messages": ASK, "system": "Be brief.", "tools": [WEATHER], "tool_choice": ANY},
    ]
    for ask in asks:
        counted = client.messages.count_tokens(model=name(served), **ask)
        reply = client.messages.create(model=name(served), max_tokens=4, **ask)
        assert counted.input_tokens == prompt_of(reply.usage) > 0
    assert len(served.recorder.enqueued()) == 2  # counting queues nothing


def test_a_repeated_prompt_is_reported_as_read_from_the_cache(
    client: anthropic.Anthropic, served: Served
) -> None:
    """The second ask of a long conversation computes only its tail: ``usage`` says so
    the way Anthropic's does, in a whole answer and at a stream's end, and the parts
    add up to what ``count_tokens`` counts."""
    system = "You are a sailor who knows every sea. " * 12
    ask: dict[str, Any] = {"model": name(served), "system": system, "messages": SEA}
    counted = client.messages.count_tokens(**ask).input_tokens
    first = client.messages.create(max_tokens=4, extra_body=GREEDY, **ask)
    second = client.messages.create(max_tokens=4, extra_body=GREEDY, **ask)
    with client.messages.stream(max_tokens=4, extra_body=GREEDY, **ask) as stream:
        streamed = stream.get_final_message()
    for reply, n in ((first, 0), (second, 1), (streamed, 2)):
        assert prompt_of(reply.usage) == counted
        assert_usage(reply.usage, served.recorder.nth(n))
    assert (second.usage.cache_read_input_tokens or 0) > counted - 8
    assert second.usage.input_tokens < 8
    assert (streamed.usage.cache_read_input_tokens or 0) > counted - 8


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{"name": "t"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "x", "name": "f"}],
                    },
                    {"role": "user", "content": "go on"},
                ]
            },
            "messages[1].content[0].input",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "x",
                                "content": [{"type": "image"}],
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
    ],
    ids=[
        "server-tool",
        "bash-tool",
        "no-input-schema",
        "unnamed-choice",
        "any-without-tools",
        "tool-use-without-input",
        "tool-result-without-id",
        "image-in-tool-result",
        "tool-use-from-the-user",
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(
    client: anthropic.Anthropic, served: Served, change: dict[str, Any], named: str
) -> None:
    params: dict[str, Any] = {"model": name(served), "messages": SEA, **change}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(max_tokens=8, **params)
    with pytest.raises(anthropic.BadRequestError) as counting:
        client.messages.count_tokens(**params)
    for error in (refused.value, counting.value):
        assert isinstance(error.body, dict)
        assert error.body["error"]["type"] == "invalid_request_error"
        assert named in error.body["error"]["message"]
    assert served.recorder.events == []


def count(served: Served, body: dict[str, Any]) -> httpx.Response:
    return plainhttp.post(f"{served.url}/v1/messages/count_tokens", json=body, timeout=NET)


def test_system_messages_join_the_system_text_in_order(served: Served) -> None:
    base = {"model": name(served), "system": [{"type": "text", "text": "You are brief."}]}
    mid: list[Any] = [
        {"role": "system", "content": "Speak French."},
        *SEA,
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
    ]
    merged = count(served, {**base, "messages": mid}).json()["input_tokens"]
    system = "You are brief.\n\nSpeak French.\n\nBe kind."
    alone = count(served, {**base, "system": system, "messages": SEA}).json()["input_tokens"]
    assert merged == alone
    refused = [
        ({"messages": [{"role": "system", "content": "Hi."}]}, "'messages'"),
        ({"messages": [*mid, {"role": "assistant", "content": ""}, mid[0]]}, "messages[3]"),
        (
            {"messages": [*SEA, {"role": "system", "content": [{"type": "image"}]}]},
            "messages[1].content[0].type",
        ),
    ]
    for change, named in refused:
        answer = count(served, {**base, **change})
        assert answer.status_code == 400
        assert named in answer.json()["error"]["message"]
    assert served.recorder.events == []


ACCEPTED: list[dict[str, Any]] = [
    {"thinking": {"type": "disabled"}},
    {"thinking": {"type": "adaptive"}},
    {"thinking": {"type": "adaptive", "display": "omitted"}},
    {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
    # no tool use to clear: the prompt is the same
    {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
    {"output_config": {"effort": "high"}},
    {"output_config": {"effort": "low"}},
    {"output_config": {"effort": "max"}},
]


@pytest.mark.parametrize("option", ACCEPTED, ids=lambda o: json.dumps(o))
def test_options_that_ask_for_no_thinking_are_accepted(served: Served, option: Any) -> None:
    body = {"model": name(served), "messages": SEA}
    assert count(served, {**body, **option}).json() == count(served, body).json()


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.type"),
        ({"thinking": {"type": "adaptive", "budget_tokens": 2048}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        (
            {"context_management": {"edits": [{"type": "clear_everything"}]}},
            "context_management.edits.0",
        ),
        (
            {
                "context_management": {
                    "edits": [
                        {
                            "type": "clear_tool_uses_20250919",
                            "keep": {"type": "input_tokens", "value": 3},
                        }
                    ]
                }
            },
            "context_management.edits[0].keep.type",
        ),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ],
    ids=["enabled", "budget", "unknown", "edit-type", "keep-type", "effort", "format-no-schema"],
)
def test_options_that_would_change_the_answer_are_refused(
    client: anthropic.Anthropic, served: Served, option: dict[str, Any], named: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=name(served), max_tokens=8, messages=SEA, extra_body=option)
    assert count(served, {"model": name(served), "messages": SEA, **option}).status_code == 400
    assert isinstance(refused.value.body, dict)
    assert named in refused.value.body["error"]["message"]
    assert served.recorder.events == []
    if option == {"thinking": {"type": "enabled", "budget_tokens": 2048}}:
        # The advice in this API's own values, not the SDK's booleans.
        message = refused.value.body["error"]["message"]
        assert 'send {"type": "disabled"} or leave it out' in message
        assert "false" not in message


def test_a_final_assistant_turn_is_continued(client: anthropic.Anthropic, served: Served) -> None:
    """Anthropic's prefill: the reply continues the final assistant turn's text (its
    prompt ends with that text, no end-of-turn marker after it) and holds only what
    follows; ``count_tokens`` counts the same prompt."""
    prefill = "My favourite colour is"
    ask: list[Any] = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": prefill},
    ]
    engine: Any = served.model().engines[0]
    request = GenerationRequest.chat(ask)
    continued = dataclasses.replace(request, continue_final=True)
    tokens = engine.tokenize_request(continued)
    assert engine._words.detokenize(tokens).endswith(prefill)  # the turn left open
    assert len(tokens) < len(engine.tokenize_request(request))  # no end marker, no new turn
    reply = client.messages.create(
        model=name(served), max_tokens=8, messages=ask, extra_body=GREEDY
    )
    text = text_of(reply)
    assert text.strip()
    assert not text.lstrip().startswith(prefill)  # the continuation alone, as Anthropic's
    assert served.recorder.nth(0).prompt_tokens == len(tokens)
    assert client.messages.count_tokens(model=name(served), messages=ask).input_tokens == len(
        tokens
    )


#: an answer's shape for ``output_config.format`` (short bounds: the small model rambles)
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
AS_PERSON: dict[str, Any] = {"output_config": {"format": {"type": "json_schema", "schema": PERSON}}}


def test_output_config_format_answers_json_that_validates(
    client: anthropic.Anthropic, served: Served
) -> None:
    """Anthropic's structured outputs: the answer is JSON of the schema, whole and
    streamed, kept by a grammar (the trace says one was compiled)."""
    ask: list[Any] = [{"role": "user", "content": "Invent a person."}]
    reply = client.messages.create(
        model=name(served), max_tokens=120, messages=ask, extra_body={**GREEDY, **AS_PERSON}
    )
    jsonschema.validate(json.loads(text_of(reply)), PERSON)
    assert reply.stop_reason == "end_turn"
    assert (reply.model_extra or {})["tokenbelt"]["grammar"]["compile_ms"] >= 0
    with client.messages.stream(
        model=name(served), max_tokens=120, messages=ask, extra_body={**GREEDY, **AS_PERSON}
    ) as stream:
        streamed = stream.get_final_message()
    jsonschema.validate(json.loads(text_of(streamed)), PERSON)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({**AS_PERSON, "tools": [WEATHER], "tool_choice": ANY}, "output_config.format"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
            "output_config.format.schema",
        ),
    ],
    ids=["with-tools", "bad-schema"],
)
def test_an_output_format_that_cannot_be_kept_is_a_400_naming_it(
    client: anthropic.Anthropic, served: Served, extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=name(served), max_tokens=8, messages=ASK, extra_body=extra)
    assert isinstance(refused.value.body, dict)
    assert named in refused.value.body["error"]["message"]
    assert served.recorder.events == []


FIXTURES = Path(__file__).parent.parent / "fixtures"
CLAUDE_CODE = json.loads((FIXTURES / "claude_code_messages.json").read_text())
#: two tools of the recording, with integer bounds (Read), a bound too long to spell out,
#: annotations alone and a pattern (Workflow): ~1,100 prompt tokens; all 25 make ~7,300
#: (their schemas are all planned in the test above)
SAMPLED_TOOLS = ("Read", "Workflow")


#: how Claude Code (2.x) reads a context overflow out of an error's message
CLAUDE_CODE_TOO_LONG = r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)"


def test_claude_codes_whole_request_is_read_to_its_last_field(served: Served) -> None:
    body = CLAUDE_CODE["body"]
    assert len(body["tools"]) == 25
    prompt = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}
    prompt["model"] = name(served)  # recorded as ANTHROPIC_MODEL=smollm2-135m
    answer = plainhttp.post(
        f"{served.url}/v1/messages/count_tokens",
        json=prompt,
        headers=CLAUDE_CODE["headers"],
        timeout=NET,
    )
    # Every field, block and tool schema passed (the tools' grammar is planned before the
    # count), and the whole of it fits the default context (the model's 8,192).
    assert answer.status_code == 200, answer.text
    assert 5000 < answer.json()["input_tokens"] < 8192
    # Longer than the context: refused in Anthropic's words, on both routes.
    first, *rest = prompt["messages"]
    pad = {"type": "text", "text": " ".join(f"note {i} on the build." for i in range(1200))}
    prompt["messages"] = [{**first, "content": [*first["content"], pad]}, *rest]
    answer = plainhttp.post(
        f"{served.url}/v1/messages/count_tokens",
        json=prompt,
        headers=CLAUDE_CODE["headers"],
        timeout=NET,
    )
    assert answer.status_code == 400, answer.text
    asked = plainhttp.post(
        f"{served.url}/v1/messages",
        json={**prompt, "max_tokens": 8},
        headers=CLAUDE_CODE["headers"],
        timeout=NET,
    )
    assert asked.status_code == 400, asked.text
    for refused in (answer, asked):
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error"
        # Anthropic's words, matched as Claude Code matches them (it then compacts)
        found = re.search(CLAUDE_CODE_TOO_LONG, error["message"], re.IGNORECASE)
        assert found is not None, error["message"]
        assert int(found[1]) > 8192
        assert int(found[2]) == 8191
        assert "each sequence holds 8192" in error["message"]  # and tokenbelt's own account


def test_a_claude_code_request_streams_an_anthropic_message(served: Served) -> None:
    body = dict(CLAUDE_CODE["body"])
    body["tools"] = [t for t in body["tools"] if t["name"] in SAMPLED_TOOLS]
    body["max_tokens"] = 8
    body["model"] = name(served)
    assert body["stream"] is True  # as recorded
    with plainhttp.stream(
        "POST",
        served.url + CLAUDE_CODE["path"],  # ?beta=true, and the anthropic-beta header
        json=body,
        headers=CLAUDE_CODE["headers"],
        timeout=NET,
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line]
    names = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    events = collect(lines)
    assert [e["type"] for e in events] == names
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    stops = [e for e in events if e["type"] == "content_block_stop"]
    assert [e["index"] for e in starts] == [e["index"] for e in stops] == list(range(len(starts)))
    assert starts
    delta = events[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    trace = served.recorder.nth(0)
    start = events[0]["message"]["usage"]
    assert start["input_tokens"] + start["cache_read_input_tokens"] == trace.prompt_tokens
    assert delta["usage"]["input_tokens"] == trace.prompt_tokens - trace.cached_tokens
    assert delta["usage"]["cache_read_input_tokens"] == trace.cached_tokens
    assert delta["usage"]["output_tokens"] == trace.completion_tokens <= 8


def test_service_tier_is_accepted_with_anthropics_values(
    client: anthropic.Anthropic, served: Served
) -> None:
    """The anthropic SDK's ``service_tier`` argument: one tier here, so ``auto`` and
    ``standard_only`` ask the same; any other value is a 400 naming the field."""
    for tier in ("auto", "standard_only"):
        reply = client.messages.create(
            model=name(served),
            max_tokens=4,
            messages=SEA,
            extra_body=GREEDY,
            service_tier=tier,  # type: ignore[arg-type]
        )
        assert text_of(reply)
    with pytest.raises(anthropic.BadRequestError, match="service_tier"):
        client.messages.create(
            model=name(served),
            max_tokens=4,
            messages=SEA,
            service_tier="priority",  # type: ignore[arg-type]
        )
