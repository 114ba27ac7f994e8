"""Request ids: a caller's own ``x-request-id`` (a tokenbelt front passes its id to its
upstream, a non-streaming client cancels by it), and an id on every answer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import plainhttp
from tokenbelt import EndReason, ScriptedEngine
from tokenbelt.server import ServerSettings

from ..conftest import (
    CHAT,
    NET,
    RawClient,
    ServeFactory,
    StallingEngine,
    chat_body,
    scripted_runtime,
)


def test_a_new_well_formed_id_is_used_once(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine([" a", " b"], delay=0.0)))

    def ask(request_id: str) -> str:
        answer = plainhttp.post(
            served.url + CHAT, json=chat_body(), headers={"x-request-id": request_id}, timeout=NET
        )
        assert answer.status_code == 200, answer.text
        given: str = answer.headers["x-request-id"]
        assert answer.json()["id"] == given
        return given

    assert ask("req_front_1") == "req_front_1"
    # Taken already, or not an id we would put in a URL: a new one of the server's own.
    again = ask("req_front_1")
    assert again != "req_front_1"
    assert again.startswith("req_")
    odd = ask("../../etc")
    assert odd.startswith("req_")
    found = plainhttp.get(f"{served.url}/v1/requests/req_front_1", timeout=NET).json()
    assert found["end_reason"] == "stop"


def test_every_answer_carries_a_request_id_429_included(serve: ServeFactory) -> None:
    served = serve(
        scripted_runtime(StallingEngine([" a"]), queue_size=1), ServerSettings(max_body_bytes=4096)
    )
    hog = served.model().stream(prompt="hold the only slot")
    served.recorder.wait(hog.trace, "first_token")
    queued = served.model().stream(prompt="fill the queue")
    served.recorder.wait(queued.trace, "enqueued")

    refused = plainhttp.post(served.url + CHAT, json=chat_body(), timeout=NET)
    assert refused.status_code == 429
    request_id = refused.headers["x-request-id"]
    # The refusal is recorded under the id it was given.
    record = plainhttp.get(f"{served.url}/v1/requests/{request_id}", timeout=NET).json()
    assert record["end_reason"] == "rejected"
    mine = plainhttp.post(
        served.url + CHAT, json=chat_body(), headers={"x-request-id": "mine-429"}, timeout=NET
    )
    assert (mine.status_code, mine.headers["x-request-id"]) == (429, "mine-429")
    # The same on the other APIs.
    for path, body in (
        ("/api/chat", {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}),
        (
            "/v1/messages",
            {"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ):
        other = plainhttp.post(served.url + path, json=body, timeout=NET)
        assert other.status_code == 429, other.text
        found = plainhttp.get(
            f"{served.url}/v1/requests/{other.headers['x-request-id']}", timeout=NET
        )
        assert found.json()["end_reason"] == "rejected"

    for answer in (
        plainhttp.post(served.url + CHAT, json={"messages": 3}, timeout=NET),  # invalid body
        plainhttp.post(served.url + CHAT, content=b"x" * 5000, timeout=NET),  # too large
        plainhttp.post(served.url + CHAT, json=chat_body(model="nope"), timeout=NET),
        plainhttp.get(f"{served.url}/v1/requests/req_unknown", timeout=NET),
        plainhttp.delete(served.url + CHAT, timeout=NET),
        plainhttp.get(f"{served.url}/nowhere", timeout=NET),
        plainhttp.get(f"{served.url}/health", timeout=NET),
    ):
        assert answer.status_code != 200 or answer.request.url.path == "/health"
        assert answer.headers["x-request-id"].startswith("req_"), answer.request.url
    hog.cancel()
    queued.cancel()


def test_a_non_streaming_client_cancels_by_its_own_id(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(StallingEngine([" a", " b"])))
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(), headers={"x-request-id": "job-42"})
        trace = served.recorder.by_id("job-42")
        served.recorder.wait(trace, "first_token")
        cancel = plainhttp.post(f"{served.url}/v1/requests/job-42/cancel", timeout=NET)
        assert cancel.json()["cancelled"] is True
        status, headers = client.read_head()
    assert (status, headers["x-request-id"]) == (200, "job-42")
    served.assert_released(trace, EndReason.USER_CANCEL)


def test_a_cancel_before_the_stream_is_handed_over_still_stops_it(
    serve: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The submit runs on a thread: the request is enqueued and decoding before the event
    # loop hands its stream to the server state. A cancel in that window once answered
    # "not cancelled" and the request ran on. Here the handover comes 0.3 s late.
    served = serve(scripted_runtime(StallingEngine([" a", " b"])))
    state = served.app.state.tokenbelt
    track = state.track

    def late(stream: Any) -> None:
        asyncio.get_running_loop().call_later(0.3, track, stream)

    monkeypatch.setattr(state, "track", late)
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(), headers={"x-request-id": "job-43"})
        trace = served.recorder.by_id("job-43")
        served.recorder.wait(trace, "first_token")
        assert state.active("job-43") is None  # not handed over yet
        cancel = plainhttp.post(f"{served.url}/v1/requests/job-43/cancel", timeout=NET)
        assert cancel.json()["cancelled"] is True
        client.read_head()
    served.assert_released(trace, EndReason.USER_CANCEL)
