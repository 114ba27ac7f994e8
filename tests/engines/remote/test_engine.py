"""The remote engine against real tokenbelt upstreams on 127.0.0.1.

Each upstream is a tokenbelt server of scripted engines; the front is a tokenbelt
server whose model is a remote engine over them. What the upstream recorded (its own
trace API) is the evidence that a stop at the front reached it.
"""

from __future__ import annotations

import threading
import time

import pytest

import plainhttp
from engines.remote.helpers import front, silent_server, upstream, upstream_trace
from server.conftest import (
    CHAT,
    NET,
    RawClient,
    ServeFactory,
    chat_body,
    collect,
    scripted_runtime,
    words,
)
from tokenbelt import (
    EndReason,
    Limits,
    QueueFull,
    Runtime,
    ScriptedEngine,
    Upstream,
    UpstreamUnavailable,
)
from tokenbelt.cli._serve import SEND_BUFFER_BYTES

#: what the issue promises: the upstream is free this soon after a stop at the front
UPSTREAM_RELEASE_S = 0.1


def slow(n: int = 200, delay: float = 0.02, **kwargs: object) -> ScriptedEngine:
    return ScriptedEngine(words(n), delay=delay, **kwargs)  # type: ignore[arg-type]


def test_stream_and_json_through_the_front(serve: ServeFactory) -> None:
    up = upstream(serve, ScriptedEngine(words(6), delay=0.0))
    fr = front(serve, up)
    body = chat_body(stream=True, stream_options={"include_usage": True})
    with plainhttp.stream("POST", fr.url + CHAT, json=body, timeout=NET) as response:
        events = collect(response.iter_lines())
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == "".join(words(6)), events
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 6
    assert events[-3]["tokenbelt"]["end_reason"] == "stop"
    answer = plainhttp.post(fr.url + CHAT, json=chat_body(), timeout=NET).json()
    assert answer["choices"][0]["message"]["content"] == "".join(words(6))
    assert answer["choices"][0]["finish_reason"] == "stop"
    trace = answer["tokenbelt"]["trace"]
    # The front passed its request id on; the upstream's trace came back, released.
    assert trace["upstream"]["request_id"] == trace["request_id"]
    assert trace["upstream"]["trace"]["timeline_ms"]["released"] is not None
    assert trace["upstream"]["release"] == "finished"
    assert upstream_trace(up, trace["request_id"])["end_reason"] == "stop"


def test_a_prompt_of_token_ids_reaches_the_upstream_as_ids(serve: ServeFactory) -> None:
    up = upstream(serve, ScriptedEngine(words(3), delay=0.0))
    fr = front(serve, up)
    body = {"model": "scripted", "prompt": [11, 22, 33, 44], "max_tokens": 8}
    answer = plainhttp.post(fr.url + "/v1/completions", json=body, timeout=NET)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert reply["choices"][0]["text"] == "".join(words(3))
    assert reply["usage"]["prompt_tokens"] == 4  # the front counts the ids
    # The upstream (a scripted engine counts a prompt's words) got the four ids.
    trace = upstream_trace(up, reply["tokenbelt"]["trace"]["request_id"])
    assert trace["prompt_tokens"] == 4


def _front_and_upstream_stop(fr_url: str, up_url: str, request_id: str, reason: str) -> None:
    """Both sides record the stop; the upstream released within the bound of the front's."""
    deadline = time.monotonic() + NET
    while True:
        front_trace = plainhttp.get(f"{fr_url}/v1/requests/{request_id}", timeout=NET).json()
        if front_trace["timeline_ms"]["released"] is not None:
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert front_trace["end_reason"] == reason
    assert front_trace["upstream"]["release"] == "confirmed"
    up = front_trace["upstream"]["trace"]
    assert up["request_id"] == request_id
    assert up["timeline_ms"]["released"] is not None, up
    stop_at = front_trace["enqueued_at"] + front_trace["timeline_ms"]["cancel_requested"] / 1000
    released_at = up["enqueued_at"] + up["timeline_ms"]["released"] / 1000
    assert released_at - stop_at < UPSTREAM_RELEASE_S, (front_trace, up)
    assert up == plainhttp.get(f"{up_url}/v1/requests/{request_id}", timeout=NET).json()


def test_disconnect_at_the_front_stops_the_upstream(serve: ServeFactory) -> None:
    up = upstream(serve, slow())
    fr = front(serve, up)
    with RawClient(fr.url) as client:
        client.send(CHAT, chat_body(stream=True))
        client.read_head()
        request_id = client.headers["x-request-id"]
        client.read_until(b" w2")
    _front_and_upstream_stop(fr.url, up.url, request_id, "client_disconnect")
    assert upstream_trace(up, request_id)["end_reason"] == "client_disconnect"


def test_cancel_endpoint_at_the_front_is_a_user_cancel_upstream(serve: ServeFactory) -> None:
    up = upstream(serve, slow())
    fr = front(serve, up)
    with plainhttp.stream("POST", fr.url + CHAT, json=chat_body(stream=True), timeout=NET) as r:
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        next(line for line in lines if "w1" in line)
        cancel = plainhttp.post(f"{fr.url}/v1/requests/{request_id}/cancel", timeout=NET)
        assert cancel.json()["cancelled"] is True
        events = collect(lines)
    assert events[-2]["tokenbelt"]["end_reason"] == "user_cancel"
    _front_and_upstream_stop(fr.url, up.url, request_id, "user_cancel")
    assert upstream_trace(up, request_id)["end_reason"] == "user_cancel"


@pytest.mark.parametrize(
    ("limits", "engine", "reason"),
    [
        ({"first_token_timeout": 0.3}, slow(prefill_delay=NET), "first_token_timeout"),
        ({"total_timeout": 0.4}, slow(), "total_timeout"),
    ],
    ids=["first_token", "total"],
)
def test_deadlines_at_the_front_stop_the_upstream(
    serve: ServeFactory, limits: dict[str, float], engine: ScriptedEngine, reason: str
) -> None:
    up = upstream(serve, engine)
    fr = front(serve, up)
    body = chat_body(stream=True, tokenbelt=limits)
    with plainhttp.stream("POST", fr.url + CHAT, json=body, timeout=NET) as response:
        # Seen once under load: no events at all. Say what came instead, if it recurs.
        assert response.status_code == 200, response.read()
        request_id = response.headers["x-request-id"]
        events = collect(response.iter_lines())
    assert len(events) >= 2, events
    assert events[-2]["tokenbelt"]["end_reason"] == reason
    _front_and_upstream_stop(fr.url, up.url, request_id, reason)
    assert upstream_trace(up, request_id)["end_reason"] == "client_disconnect"


def test_a_non_streaming_client_that_leaves_stops_the_upstream(serve: ServeFactory) -> None:
    up = upstream(serve, slow())
    fr = front(serve, up)
    with RawClient(fr.url) as client:
        client.send(CHAT, chat_body())
        trace = fr.recorder.nth(0)
        up_trace = up.recorder.nth(0)
        up.recorder.wait(up_trace, "first_token")
    fr.recorder.wait(trace, "released")
    assert trace.end_reason is EndReason.CLIENT_DISCONNECT
    up.assert_released(up_trace, EndReason.CLIENT_DISCONNECT)
    assert trace.released is not None
    assert up_trace.released is not None
    assert up_trace.released <= trace.released


def test_upstream_errors_are_clear(serve: ServeFactory) -> None:
    up = upstream(serve, ScriptedEngine(words(3), delay=0.0))
    fr = front(serve, up, model="no-such-model", health_interval=None)
    answer = plainhttp.post(fr.url + CHAT, json=chat_body(), timeout=NET)
    # The upstream's 404 passes through, with its message.
    assert answer.status_code == 404
    assert "no-such-model" in answer.json()["error"]["message"]
    # A stream has sent its 200 already: its final chunk carries the upstream's error.
    with plainhttp.stream("POST", fr.url + CHAT, json=chat_body(stream=True), timeout=NET) as r:
        events = collect(r.iter_lines())
    error = events[-2]["error"]
    assert error["code"] == "upstream_404"
    assert "no-such-model" in error["message"]
    assert events[-2]["tokenbelt"]["end_reason"] == "runtime_error"
    failing = upstream(serve, ScriptedEngine(words(3), delay=0.0, fail_after=1))
    fr2 = front(serve, failing, health_interval=None)
    answer = plainhttp.post(fr2.url + CHAT, json=chat_body(), timeout=NET)
    assert answer.status_code == 502
    assert "scripted failure" in answer.json()["error"]["message"]


def test_options_a_tokenbelt_upstream_takes_pass_through(serve: ServeFactory) -> None:
    up = upstream(serve, ScriptedEngine(words(3), delay=0.0))
    fr = front(serve, up, health_interval=None)
    # The front passes ignore_eos on; this upstream's engine refuses it in its own words.
    answer = plainhttp.post(fr.url + CHAT, json=chat_body(ignore_eos=True), timeout=NET)
    assert answer.status_code == 400
    assert "not supported by the scripted engine" in answer.json()["error"]["message"]
    # What no upstream gets from the front: refused by the front, naming it.
    answer = plainhttp.post(fr.url + CHAT, json=chat_body(logprobs=True), timeout=NET)
    assert answer.status_code == 400
    assert "logprobs is not supported by the remote engine" in answer.text


def test_a_refused_connection_is_a_runtime_error_with_its_cause() -> None:
    with silent_server() as gone:
        url = gone.url
    with Runtime(keep_alive=None) as rt:
        model = rt.add_remote("m", [Upstream(url, "m")], health_interval=None)
        stream = model.stream([{"role": "user", "content": "hi"}])
        with pytest.raises(UpstreamUnavailable, match="refused the connection"):
            stream.read()
        assert stream.end_reason is EndReason.RUNTIME_ERROR
        assert stream.wait_released(NET)


def test_an_upstream_that_never_answers_meets_the_first_token_deadline() -> None:
    with silent_server() as silent, Runtime(keep_alive=None) as rt:
        model = rt.add_remote("m", [Upstream(silent.url, "m")], health_interval=None)
        stream = model.stream([{"role": "user", "content": "hi"}], limits=Limits(first_token=0.3))
        reply = stream.read()
        assert reply.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
        assert silent.accepted.is_set()
        # The front closed the connection at the deadline: the upstream sees EOF.
        assert silent.closed.wait(NET)
        assert stream.wait_released(NET)


def test_a_paused_reader_pauses_the_upstream(serve: ServeFactory) -> None:
    piece = 16 * 1024
    engine = ScriptedEngine(words(2000, size=piece), delay=0.0)
    # The send buffer ``tokenbelt serve`` fixes on its sockets.
    up = serve(scripted_runtime(engine), sndbuf=SEND_BUFFER_BYTES)
    with Runtime(keep_alive=None, capacity=2) as rt:
        model = rt.add_remote("scripted", [Upstream(up.url, "scripted")], health_interval=None)
        stream = model.stream([{"role": "user", "content": "hi"}], max_tokens=2000)
        pieces = iter(stream)  # kept: a dropped iterator would stop the stream
        first = next(pieces)
        assert first.startswith("00000000")
        # Wait until the upstream stops: TCP buffers fill, then its belt, then its engine.
        seen, still = -1, 0
        while still < 20:
            time.sleep(0.02)
            now = engine.tokens_computed
            still = still + 1 if now == seen else 0
            seen = now
        # Bounded by the buffers on the way (upstream belt and socket, front socket and
        # belt), each a few pieces here: far from the 2,000 asked for.
        assert engine.tokens_computed < 200, engine.tokens_computed
        stream.cancel()
        assert stream.wait_released(NET)
    # A stop from the SDK is a user_cancel, and the upstream records the same.
    up.assert_released(up.recorder.nth(0), EndReason.USER_CANCEL)


def test_two_upstreams_share_the_load(serve: ServeFactory) -> None:
    ups = [upstream(serve, slow(20, 0.02), slow(20, 0.02), slots=2) for _ in range(2)]
    fr = front(serve, *ups, max_concurrency=2)
    done = []

    def one() -> None:
        answer = plainhttp.post(fr.url + CHAT, json=chat_body(), timeout=NET)
        done.append(answer.status_code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(NET)
    assert done == [200] * 4
    counts = [len([e for e in u.recorder.events if e.kind == "enqueued"]) for u in ups]
    assert counts == [2, 2]


def test_shutdown_of_the_front_stops_the_upstream(serve: ServeFactory) -> None:
    up = upstream(serve, slow())
    runtime = Runtime(keep_alive=None)
    model = runtime.add_remote(
        "scripted", [Upstream(up.url, "scripted", tokenbelt=True)], health_interval=None
    )
    stream = model.stream([{"role": "user", "content": "hi"}])
    pieces = iter(stream)
    next(pieces)
    runtime.close()
    assert stream.end_reason is EndReason.SHUTDOWN
    assert stream.trace.released is not None
    up_trace = up.recorder.nth(0)
    up.assert_released(up_trace, EndReason.CLIENT_DISCONNECT)
    assert up_trace.released is not None
    assert up_trace.released <= stream.trace.released


def test_the_concurrency_limit_feeds_the_admission_queue(serve: ServeFactory) -> None:
    up = upstream(serve, slow(), slow(), slots=2)
    with Runtime(keep_alive=None, queue_size=1) as rt:
        model = rt.add_remote(
            "scripted", [Upstream(up.url, "scripted", max_concurrency=1)], health_interval=None
        )
        first = model.stream([{"role": "user", "content": "one"}])
        second = model.stream([{"role": "user", "content": "two"}])
        stats = model.statistics()
        assert (stats.slots, stats.running, stats.queued) == (1, 1, 1)
        with pytest.raises(QueueFull):
            model.stream([{"role": "user", "content": "three"}])
        first.cancel()
        # The queued request starts once the first has let go of the upstream.
        pieces = iter(second)
        next(pieces)
        assert first.trace.released is not None
        assert second.trace.admitted is not None
        assert second.trace.admitted >= first.trace.released
        second.cancel()
        assert second.wait_released(NET)
