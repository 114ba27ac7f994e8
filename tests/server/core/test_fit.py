"""A chat longer than its window loses its oldest turns, not the request: Ollama's chat
(window ``options.num_ctx``, else the context) and the Responses API with
``truncation: "auto"``, driven by the official ``ollama`` and ``openai`` clients against the
real default model. The system message and the latest turn stay, a tool result never
loses its call, the cut moves by whole grid steps (so the next turns start where this one
did, from the prefix cache), and the trace counts what went."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from tokenbelt import EndReason, GenerationRequest, SamplingParams, ScriptedEngine
from tokenbelt.server.core._fit import GRID_SHARE, cut_limit, reply_room

from ..conftest import (
    NET,
    Served,
    ServeFactory,
    SharedServer,
    connect_ollama,
    real_runtime,
    scripted_runtime,
    words,
)
from ..conftest import shared_server as shared_server_of

pytestmark = pytest.mark.model

#: tokens per sequence of the test server: a dozen turns outgrow it
N_CTX = 384
SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one word."}


def conversation(turns: int) -> list[dict[str, Any]]:
    """``turns`` exchanges of about 30 tokens each, then a last question."""
    messages: list[dict[str, Any]] = [SYSTEM]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Fact {i}: the {i}th stone is grey " * 2})
        messages.append({"role": "assistant", "content": f"Noted fact {i}, the grey stone."})
    messages.append({"role": "user", "content": "Which colour are the stones?"})
    return messages


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    with shared_server_of(lambda: real_runtime(n_ctx=N_CTX, slots=1)) as server:
        yield server


def room(max_tokens: int, window: int) -> int:
    return reply_room(GenerationRequest(prompt="x", sampling=SamplingParams(max_tokens)), window)


def limit_for(served: Served, messages: list[dict[str, Any]], max_tokens: int, window: int) -> int:
    return cut_limit(tokens(served, messages), room(max_tokens, window), window)


def tokens(served: Served, messages: list[dict[str, Any]]) -> int:
    request = GenerationRequest.chat(messages)  # type: ignore[arg-type]
    return len(served.model().prompt_token_ids(request))


def assert_fewest_dropped(
    served: Served, messages: list[dict[str, Any]], dropped: int, prompt: int, limit: int
) -> None:
    """The prompt run was the system message with the turns after the ``dropped``
    oldest; and one turn more (from the previous user or assistant message) would not
    have fit ``limit``."""
    kept = [messages[0], *messages[1 + dropped :]]
    assert tokens(served, kept) == prompt <= limit
    assert kept[1]["role"] != "tool"
    earlier = max(i for i in range(1, 1 + dropped) if messages[i]["role"] != "tool")
    assert tokens(served, [messages[0], *messages[earlier:]]) > limit


def test_an_ollama_chat_longer_than_the_context_keeps_its_system_and_latest_turns(
    served: Served,
) -> None:
    messages = conversation(14)
    name = served.model().name
    assert tokens(served, messages) > N_CTX  # it would not fit whole
    with connect_ollama(served.url) as client:
        reply = client.chat(name, messages=messages, options={"num_predict": 8, "seed": 1})
    trace = served.recorder.nth(0)
    served.assert_released(trace, trace.end_reason or EndReason.RUNTIME_ERROR)
    assert reply.done is True
    assert reply.message.content
    assert trace.dropped_messages > 0
    assert reply.prompt_eval_count == trace.prompt_tokens
    limit = limit_for(served, messages, 8, N_CTX)
    assert_fewest_dropped(served, messages, trace.dropped_messages, trace.prompt_tokens, limit)


def test_the_next_turns_of_a_cut_chat_start_where_it_did_from_the_prefix_cache(
    served: Served,
) -> None:
    messages = conversation(14)
    whole = tokens(served, messages)
    # A window where this chat's cut is early in its grid cell: a turn more stays in it.
    window = next(
        w
        for w in range(N_CTX, N_CTX // 2, -1)
        if -(whole + room(8, w) - w) % (w // GRID_SHARE) >= 60
    )
    options = {"num_predict": 8, "seed": 1, "num_ctx": window}
    name = served.model().name
    with connect_ollama(served.url) as client:
        reply = client.chat(name, messages=messages, options=options)
        first = served.recorder.nth(0)
        messages += [
            {"role": "assistant", "content": reply.message.content},
            {"role": "user", "content": "And the sky?"},
        ]
        assert tokens(served, messages) - whole < 60  # within the cell
        client.chat(name, messages=messages, options=options)
    after = served.recorder.nth(1)
    assert first.dropped_messages > 0
    assert after.dropped_messages == first.dropped_messages
    assert after.prompt_tokens > first.prompt_tokens
    assert after.cached_tokens >= first.prompt_tokens


def test_a_cut_leaves_the_reply_room_and_moves_only_a_whole_grid_step() -> None:
    window, room_ = 4096, 512
    grid = window // GRID_SHARE
    cuts = {}
    for whole in range(window - room_ + 1, 3 * window):
        limit = cut_limit(whole, room_, window)
        assert limit + room_ <= window
        assert (whole - limit) % grid == 0
        assert limit + room_ + grid > window  # no more than a grid step beyond the room
        cuts.setdefault(whole - limit, []).append(whole)
    # every cut size holds for a whole grid step of growth: the next turns start alike
    assert all(len(wholes) == grid for wholes in list(cuts.values())[:-1])


def test_num_ctx_is_the_window_an_ollama_chat_is_fitted_to(served: Served) -> None:
    messages = conversation(6)  # fits the context whole
    name = served.model().name
    with connect_ollama(served.url) as client:
        whole = client.chat(name, messages=messages, options={"num_predict": 4})
        fitted = client.chat(name, messages=messages, options={"num_predict": 4, "num_ctx": 160})
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(name, messages=messages, options={"num_predict": 4, "num_ctx": 20})
    first, second = served.recorder.nth(0), served.recorder.nth(1)
    assert first.dropped_messages == 0
    assert whole.prompt_eval_count == tokens(served, messages)
    assert second.dropped_messages > 0
    assert fitted.prompt_eval_count == second.prompt_tokens
    limit = limit_for(served, messages, 4, 160)
    assert_fewest_dropped(served, messages, second.dropped_messages, second.prompt_tokens, limit)
    # the system message and the latest question alone outgrow a 20-token window
    assert refused.value.status_code == 400
    assert "context window of 20 tokens" in str(refused.value.error)


def test_a_num_ctx_larger_than_the_context_serves_what_that_window_would_hold(
    served: Served,
) -> None:
    """Ollama would load the model again with the larger window; a chat that fits the
    loaded one runs whole as it would there, and one that does not is refused by name
    instead of losing turns the asked-for window would have kept."""
    name = served.model().name
    options = {"num_predict": 4, "num_ctx": 8 * N_CTX}
    short, long = conversation(2), conversation(14)
    with connect_ollama(served.url) as client:
        reply = client.chat(name, messages=short, options=options)
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(name, messages=long, options=options)
    assert reply.prompt_eval_count == tokens(served, short)
    assert served.recorder.nth(0).dropped_messages == 0
    assert refused.value.status_code == 400
    said = str(refused.value.error)
    assert "options.num_ctx" in said
    assert f"a window of {8 * N_CTX} would hold it" in said
    assert f"context window of {N_CTX} tokens" in said


def test_a_tool_result_goes_with_its_call(served: Served) -> None:
    call = {"function": {"name": "stone_colour", "arguments": {"stone": 1}}}
    messages: list[dict[str, Any]] = [SYSTEM]
    for i in range(5):
        messages.append({"role": "user", "content": f"Which colour is stone {i}? " * 3})
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        # a long result: the cut would fall on it if results could head a chat
        messages.append({"role": "tool", "content": "grey, like slate and ash " * 8})
    messages.append({"role": "user", "content": "And the stones together?"})
    name = served.model().name
    with connect_ollama(served.url) as client:
        reply = client.chat(name, messages=messages, options={"num_predict": 4, "num_ctx": 200})
    trace = served.recorder.nth(0)
    assert trace.dropped_messages > 0
    kept = messages[1 + trace.dropped_messages]
    assert kept["role"] in ("user", "assistant")
    assert reply.prompt_eval_count == trace.prompt_tokens <= 199


def test_responses_truncation_auto_leaves_the_oldest_items_out(served: Served) -> None:
    messages = conversation(14)
    items = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as whole:
        client.responses.create(
            model=served.model().name,
            instructions=SYSTEM["content"],
            input=items,  # type: ignore[arg-type]
            max_output_tokens=8,
        )
    assert whole.value.code == "context_length_exceeded"
    response = client.responses.create(
        model=served.model().name,
        instructions=SYSTEM["content"],
        input=items,  # type: ignore[arg-type]
        max_output_tokens=8,
        truncation="auto",
    )
    trace = served.recorder.nth(0)  # the refused one was never queued
    assert response.status in ("completed", "incomplete")
    assert response.truncation == "auto"
    assert response.usage is not None
    assert response.usage.input_tokens == trace.prompt_tokens
    assert trace.dropped_messages > 0
    limit = limit_for(served, messages, 8, N_CTX)
    assert_fewest_dropped(served, messages, trace.dropped_messages, trace.prompt_tokens, limit)


def test_an_engine_that_counts_no_tokens_refuses_truncation_it_cannot_do(
    serve: ServeFactory,
) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(4))))
    body = {"model": "scripted", "input": conversation(1), "truncation": "auto"}
    answer = httpx.post(served.url + "/v1/responses", json=body, timeout=NET)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "truncation"
    assert "counts no prompt tokens" in error["message"]
    # Ollama's chat is fitted by default: such an engine gets it whole, num_ctx or not
    for options in ({}, {"num_ctx": 64}):
        chat = {"model": "scripted", "messages": conversation(2), "stream": False}
        answer = httpx.post(
            served.url + "/api/chat", json={**chat, "options": options}, timeout=NET
        )
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_chat_that_fits_is_tokenized_once(isolation: str) -> None:
    """Fitting counts the chat's tokens; the engine keeps them for its submit."""
    from tokenbelt.server.core._fit import Fit, fit_messages

    runtime = real_runtime(n_ctx=N_CTX, slots=1, isolation=isolation)
    try:
        model = runtime.models[next(iter(runtime.models))]
        engine = model.engines[0]
        made: list[int] = []
        tokenize = engine.tokenize_request

        def counted(request: GenerationRequest) -> list[int]:
            made.append(1)
            return tokenize(request)

        engine.tokenize_request = counted  # type: ignore[method-assign]
        request = GenerationRequest.chat(conversation(2), SamplingParams(max_tokens=2))
        fitted, dropped = fit_messages(model, request, Fit(N_CTX))
        assert (fitted, dropped) == (request, 0)
        reply = model.submit(fitted)
        reply.read()
        assert reply.trace.end_reason in (EndReason.STOP, EndReason.LENGTH)
        assert len(made) == 1
    finally:
        runtime.close()
