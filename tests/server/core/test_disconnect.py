"""A client that goes away stops the model: queued, in prefill and in decode, streaming or not.

The client is a raw socket the test closes; the server learns of it from the ASGI
``receive`` channel. Each test checks the end reason (in the runtime's trace and in the
server's record), that the release is recorded and that the engine is idle at that moment.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

import plainhttp
from tokenbelt import EndReason, ScriptedEngine
from tokenbelt.belt import Trace

from ..conftest import (
    CHAT,
    COMPLETIONS,
    LONG_PROMPT,
    NET,
    RawClient,
    Served,
    ServeFactory,
    chat_body,
    real_runtime,
    scripted_runtime,
    sse_events,
    wait_in_prefill,
    words,
)


def record(served: Served, request_id: str) -> dict[str, object]:
    response = plainhttp.get(f"{served.url}/v1/requests/{request_id}", timeout=NET)
    assert response.status_code == 200
    body: dict[str, object] = response.json()
    return body


def assert_disconnected(served: Served, request_id: str) -> None:
    trace = served.recorder.by_id(request_id)
    served.assert_released(trace, EndReason.CLIENT_DISCONNECT)
    body = record(served, request_id)
    assert body["end_reason"] == "client_disconnect"
    timeline = body["timeline_ms"]
    assert isinstance(timeline, dict)
    assert timeline["cancel_requested"] is not None
    assert timeline["released"] is not None
    assert body["cancel_to_release_ms"] is not None


def leave_after_the_first_event(served: Served, body: dict[str, Any]) -> Trace:
    """Stream ``body`` from a raw socket closed after the first event; the request's
    trace, once its disconnect is recorded and released."""
    with RawClient(served.url) as client:
        client.send(CHAT, body)
        client.read_head()
        client.read_until(b"data: ")
        trace = served.recorder.nth(0)
    assert_disconnected(served, trace.request_id)
    return trace


# -- scripted engine: every phase, streaming and not --------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_while_queued(serve: ServeFactory, stream: bool) -> None:
    engine = ScriptedEngine(words(50), prefill_delay=NET)
    served = serve(scripted_runtime(engine))
    hog = served.model().stream(prompt="hold the only slot")
    served.recorder.wait(hog.trace, "admitted")

    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(stream=stream))
        trace = served.recorder.nth(1)
        if stream:
            status, headers = client.read_head()  # the head is sent while still queued
            assert status == 200
            assert headers["x-request-id"] == trace.request_id
        served.wait_queued(1)
    served.recorder.wait(trace, "released")

    assert trace.end_reason is EndReason.CLIENT_DISCONNECT
    assert trace.admitted is None, "a queued request that left must never reach a slot"
    assert record(served, trace.request_id)["end_reason"] == "client_disconnect"
    stats = served.model().statistics()
    assert (stats.queued, stats.running) == (0, 1)  # only the hog is left

    hog.cancel()
    served.assert_released(hog.trace, EndReason.USER_CANCEL)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_in_prefill(serve: ServeFactory, stream: bool) -> None:
    engine = ScriptedEngine(words(50), prefill_delay=NET)
    served = serve(scripted_runtime(engine))
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(stream=stream))
        trace = served.recorder.nth(0)
        served.recorder.wait(trace, "admitted")
        assert trace.first_token is None
    assert_disconnected(served, trace.request_id)
    assert engine.tokens_computed == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_in_decode(serve: ServeFactory, stream: bool) -> None:
    engine = ScriptedEngine(words(100_000), delay=0.002)
    served = serve(scripted_runtime(engine))
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(stream=stream, max_tokens=100_000))
        trace = served.recorder.nth(0)
        if stream:
            client.read_head()
            client.read_until(b"data: ")
        served.recorder.wait(trace, "first_token")
    assert_disconnected(served, trace.request_id)
    computed = engine.tokens_computed
    assert 0 < computed < 100_000
    assert trace.completion_tokens == computed


def test_disconnect_of_one_request_leaves_the_next_running(serve: ServeFactory) -> None:
    engine = ScriptedEngine(words(20), prefill_delay=0.0, delay=0.001)
    served = serve(scripted_runtime(engine))
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(stream=True))
        client.read_head()
    first = served.recorder.nth(0)
    served.recorder.wait(first, "released")
    reply = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(max_tokens=5), timeout=NET)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["finish_reason"] == "length"


# -- the cancel endpoint ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_cancel_endpoint_is_user_cancel(serve: ServeFactory, stream: bool) -> None:
    engine = ScriptedEngine(words(100_000), delay=0.002)
    served = serve(scripted_runtime(engine))
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(stream=stream, max_tokens=100_000))
        trace = served.recorder.nth(0)
        served.recorder.wait(trace, "first_token")
        url = f"{served.url}/v1/requests/{trace.request_id}/cancel"
        answer = plainhttp.post(url, timeout=NET)
        assert answer.status_code == 200
        assert answer.json() == {
            "id": trace.request_id,
            "cancelled": True,
            "end_reason": "user_cancel",
        }
        status, headers = client.read_head()
        assert status == 200
        assert headers["x-request-id"] == trace.request_id
        if stream:
            events = sse_events(client.read_until(b"data: [DONE]"))
            assert events[-1] == "[DONE]"
            final = events[-2]
            assert final["choices"][0]["finish_reason"] == "stop"  # a stop, not a timeout
            assert final["tokenbelt"]["end_reason"] == "user_cancel"
            assert final["tokenbelt"]["trace"]["timeline_ms"]["released"] is not None
        else:
            assert "x-tokenbelt-trace" in headers
    served.assert_released(trace, EndReason.USER_CANCEL)

    again = plainhttp.post(url, timeout=NET)  # after the end: a no-op that says how it ended
    assert again.status_code == 200
    assert again.json() == {"id": trace.request_id, "cancelled": False, "end_reason": "user_cancel"}


def test_cancel_and_record_of_an_unknown_request_are_404(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3))))
    for response in (
        plainhttp.post(f"{served.url}/v1/requests/req_nope/cancel", timeout=NET),
        plainhttp.get(f"{served.url}/v1/requests/req_nope", timeout=NET),
    ):
        assert response.status_code == 404
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "request_not_found"


# -- the real default model -------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_real_model_disconnect_during_a_long_prefill(serve: ServeFactory, stream: bool) -> None:
    served = serve(real_runtime())
    with RawClient(served.url) as client:
        client.send(COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": 8, "stream": stream})
        trace = served.recorder.nth(0)
        assert trace.prompt_tokens > 1500
        wait_in_prefill(served, trace)
        assert trace.first_token is None
    assert_disconnected(served, trace.request_id)
    assert trace.completion_tokens == 0


@pytest.mark.model
def test_real_model_disconnect_in_decode(serve: ServeFactory) -> None:
    served = serve(real_runtime())
    # Greedy, and no end of generation for well over a hundred tokens on this model.
    body = chat_body("Tell me about the sea.", max_tokens=2000, temperature=0.0, stream=True)
    trace = leave_after_the_first_event(served, body)
    assert 0 < trace.completion_tokens < 2000


@pytest.mark.model
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_what_a_client_that_left_computed_serves_its_retry(
    serve: ServeFactory, isolation: str
) -> None:
    """The cells a disconnected request computed stay in the prefix cache (in the worker
    too): the same request again computes only its prompt's last token."""
    served = serve(real_runtime(isolation=isolation))
    body = chat_body(
        "Tell me about the sea, the ships and the " + " ".join(words(60)),
        max_tokens=2000,
        temperature=0.0,
        stream=True,
    )
    trace = leave_after_the_first_event(served, body)
    again = plainhttp.post(
        f"{served.url}{CHAT}", json={**body, "stream": False, "max_tokens": 2}, timeout=NET
    )
    assert again.status_code == 200, again.text
    usage = again.json()["usage"]
    assert usage["prompt_tokens"] == trace.prompt_tokens > 60
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


@pytest.mark.model
def test_the_event_loop_answers_during_a_long_real_prefill(serve: ServeFactory) -> None:
    served = serve(real_runtime())
    with RawClient(served.url) as client, httpx.Client(timeout=NET) as other:
        client.send(COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": 8, "stream": True})
        trace = served.recorder.nth(0)
        wait_in_prefill(served, trace)  # the long prompt is being evaluated
        other.get(f"{served.url}/health")  # connect outside the timed part
        for _ in range(5):
            started = time.perf_counter()
            response = other.get(f"{served.url}/health")
            elapsed = time.perf_counter() - started
            assert response.status_code == 200
            assert elapsed < 0.5, f"/health took {elapsed:.3f} s during a prefill"
        assert trace.first_token is None, "the checks must overlap the prefill"
    assert_disconnected(served, trace.request_id)
