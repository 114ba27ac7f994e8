"""Backpressure over the network: a reader that stops reading pauses generation.

The chain is belt (``capacity`` pieces) -> SSE writer -> uvicorn's transport (it stops
``send`` above its high-water mark) -> kernel socket buffers -> the client. A client
that reads nothing fills the socket buffers, the writer stops pulling from the belt, the
belt fills and the engine waits for room before computing the next piece. Large pieces
(2 KB) and small socket buffers make the chain fill within a few dozen pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

from tokenbelt import EndReason, ScriptedEngine

from ..conftest import (
    CHAT,
    NET,
    RawClient,
    ServeFactory,
    chat_body,
    scripted_runtime,
    sse_events,
    words,
)

PIECE = 2048
CAPACITY = 8
SNDBUF = 8192
RCVBUF = 4096


def settle(read: Callable[[], int], quiet: float = 0.5) -> int:
    """Wait until ``read()`` has stayed the same for ``quiet`` seconds; return it."""
    deadline = time.monotonic() + NET
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "generation never paused"
        time.sleep(0.02)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def content(events: list[object]) -> str:
    text = []
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            text.append(event["choices"][0]["delta"].get("content", ""))
    return "".join(text)


def test_a_stalled_reader_pauses_generation_and_resumes(serve: ServeFactory) -> None:
    script = words(4000, PIECE)  # 8 MB if nothing held the engine back
    engine = ScriptedEngine(script, delay=0)
    served = serve(scripted_runtime(engine), sndbuf=SNDBUF)
    state = served.app.state.tokenbelt
    # A stall limit far shorter than the pause: waiting on a reader is not a stall.
    options = {"capacity": CAPACITY, "stall_timeout": 0.2}
    with RawClient(served.url, rcvbuf=RCVBUF) as client:
        client.send(CHAT, chat_body(stream=True, max_tokens=len(script), tokenbelt=options))
        trace = served.recorder.nth(0)
        served.recorder.wait(trace, "first_token")

        paused_at = settle(lambda: trace.completion_tokens)
        rss_before = psutil.Process().memory_info().rss
        # The window: nothing more is computed while the client reads nothing.
        window_end = time.monotonic() + 1.0
        while time.monotonic() < window_end:
            assert trace.completion_tokens == paused_at
            time.sleep(0.05)
        rss_growth = psutil.Process().memory_info().rss - rss_before

        assert paused_at < len(script) // 10, "the engine ran far ahead of the reader"
        assert engine.tokens_computed == paused_at
        assert trace.end_reason is None, "a paused request is still running"
        stream = state.active(trace.request_id)
        assert stream is not None
        assert stream.statistics().buffered == CAPACITY  # the belt is full, so the engine waits
        assert rss_growth < 2 * 1024 * 1024, f"memory grew by {rss_growth} bytes while paused"

        # Reading again resumes generation, to the end, in order.
        client.read_head()
        events = sse_events(client.read_until(b"data: [DONE]"))
    served.assert_released(trace, EndReason.STOP)
    assert content(events) == "".join(script)
    final = events[-2]
    assert isinstance(final, dict)
    assert final["tokenbelt"]["end_reason"] == "stop"
    assert trace.completion_tokens == len(script)
    assert trace.buffer_peak == CAPACITY


def test_a_slow_reader_gets_everything_at_its_own_pace(serve: ServeFactory) -> None:
    script = words(400, PIECE)
    engine = ScriptedEngine(script, delay=0)
    served = serve(scripted_runtime(engine), sndbuf=SNDBUF)
    options = {"capacity": CAPACITY, "stall_timeout": 5.0}
    seen: list[int] = []
    with RawClient(served.url, rcvbuf=RCVBUF) as client:
        client.send(CHAT, chat_body(stream=True, max_tokens=len(script), tokenbelt=options))
        trace = served.recorder.nth(0)
        client.read_head()
        while client.buffer.find(b"data: [DONE]", max(0, len(client.buffer) - 8200)) < 0:
            assert client.fill(8192), "the server closed the stream early"
            seen.append(trace.completion_tokens)
            time.sleep(0.002)
        events = sse_events(bytes(client.buffer))
    served.assert_released(trace, EndReason.STOP)
    assert content(events) == "".join(script)
    assert trace.buffer_peak == CAPACITY
    # Early on, generation was held back by the reader rather than finished.
    assert seen[0] < len(script) // 2, seen[:5]
    assert seen == sorted(seen)
