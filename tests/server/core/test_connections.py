"""The edges of a connection: half-closed clients, half-sent requests, readers that stop.

Raw sockets against a real uvicorn running tokenbelt's protocol (``http_protocol``):
the kernel decides what a half-close, a close and a full buffer look like.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import anyio
import pytest

from tokenbelt import EndReason, ScriptedEngine
from tokenbelt.server import ServerSettings
from tokenbelt.server.core import WRITE_PIECE_BYTES, in_pieces

from ..conftest import (
    CHAT,
    NET,
    RawClient,
    ServeFactory,
    StallingEngine,
    chat_body,
    scripted_runtime,
    sse_events,
    words,
)


def json_body(raw: bytes) -> dict[str, object]:
    """The JSON body of the last answer in ``raw`` (which has a content-length)."""
    body: dict[str, object] = json.loads(raw.rsplit(b"\r\n\r\n", 1)[1])
    return body


# -- half-close -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_half_closed_client_is_served(serve: ServeFactory, stream: bool) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(20), delay=0.01)))
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(stream=stream))
        client.sock.shutdown(socket.SHUT_WR)  # as some proxies do once the request is sent
        raw = client.read_to_close()  # the server closes once the answer is out
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason.STOP)
    # An interim 100 may come first (the server's probe for a closed socket).
    assert b"HTTP/1.1 200 OK" in raw
    assert trace.request_id.encode() in raw
    if stream:
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == (
            "".join(words(20))
        )
    else:
        assert json_body(raw)["choices"][0]["message"]["content"] == "".join(words(20))  # type: ignore[index]


def test_a_client_that_closes_while_waiting_is_still_a_disconnect(serve: ServeFactory) -> None:
    engine = StallingEngine([" a"])
    served = serve(scripted_runtime(engine))
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(stream=False))
        trace = served.recorder.nth(0)
        served.recorder.wait(trace, "first_token")
    # close(): the same FIN as a half-close; the server's probe tells them apart.
    served.assert_released(trace, EndReason.CLIENT_DISCONNECT)


# -- the read deadline ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sent",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"messages": ',
    ],
    ids=["half-a-head", "half-a-body"],
)
def test_a_half_sent_request_is_closed_after_the_read_timeout(
    serve: ServeFactory, sent: bytes
) -> None:
    served = serve(
        scripted_runtime(ScriptedEngine(words(3), delay=0)), ServerSettings(read_timeout=0.5)
    )
    with RawClient(served.url) as client:
        client.sock.sendall(sent)
        started = time.monotonic()
        raw = client.read_to_close()
        waited = time.monotonic() - started
    assert raw.startswith(b"HTTP/1.1 408 ")
    assert b"\r\nx-request-id: req_" in raw
    error = json_body(raw)["error"]
    assert isinstance(error, dict)
    assert error["code"] == "request_timeout"
    assert waited < NET
    assert served.recorder.events == [], "half a request never reaches the model"


def test_malformed_http_gets_an_error_body_and_a_request_id(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))
    with RawClient(served.url) as client:
        client.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nno colon here\r\n\r\n")
        raw = client.read_to_close()
    assert raw.startswith(b"HTTP/1.1 400 ")
    assert b"\r\nx-request-id: req_" in raw
    error = json_body(raw)["error"]
    assert isinstance(error, dict)
    assert error["code"] == "bad_request"
    assert served.recorder.events == []


def test_a_silent_connection_is_closed_after_the_read_timeout(serve: ServeFactory) -> None:
    served = serve(
        scripted_runtime(ScriptedEngine(words(3), delay=0)), ServerSettings(read_timeout=0.5)
    )
    with RawClient(served.url) as client:
        assert client.read_to_close() == b""


def test_the_read_timeout_does_not_cut_an_answer_or_the_next_request(serve: ServeFactory) -> None:
    # Each answer takes longer than the read timeout; the deadline covers only the request.
    served = serve(
        scripted_runtime(ScriptedEngine(words(10), delay=0.1)), ServerSettings(read_timeout=0.5)
    )
    with RawClient(served.url) as client:
        for n in range(2):  # the same kept-alive connection
            client.send(CHAT, chat_body(stream=True))
            client.read_head()
            assert client.status == 200
            raw = client.read_until(b"data: [DONE]")
            client.buffer.clear()
            assert len(sse_events(raw)) == 10 + 2
            served.assert_released(served.recorder.nth(n), EndReason.STOP)


# -- a reader that stops reading ----------------------------------------------------------------


def test_a_reader_that_reads_nothing_is_bounded_and_ends_reader_timeout(
    serve: ServeFactory,
) -> None:
    """With default socket settings, as documented: once the client's kernel stops taking
    bytes (here at once, 1 KiB pieces being segments it cannot compact), the model pauses
    and, the reader timeout later, the stream ends and its slot is free."""
    engine = ScriptedEngine(words(200_000, size=1024), delay=0)
    served = serve(scripted_runtime(engine), ServerSettings(reader_timeout=1.0))
    with RawClient(served.url) as client:  # default socket settings: the kernel's buffers
        client.send(CHAT, chat_body(stream=True, max_tokens=200_000))
        client.read_head()
        trace = served.recorder.nth(0)
        # ... and nothing more is read.
        served.assert_released(trace, EndReason.READER_TIMEOUT)
        # The model stopped when the buffers were full: the belt, the transport's
        # buffer, the two kernels' socket buffers; far short of the 200 MB asked for.
        assert 0 < engine.tokens_computed < 200_000
        assert trace.completion_tokens * 1024 < 64 * 2**20
        # The server closed the connection: what was buffered, then the end, no [DONE].
        with contextlib.suppress(ConnectionResetError):
            while client.fill():
                pass
        assert b"data: [DONE]" not in client.buffer
    stats = served.model().statistics()
    assert (stats.running, stats.queued) == (0, 0)


# -- large bodies -------------------------------------------------------------------------------


def test_a_large_body_is_written_in_pieces_in_order() -> None:
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    body = bytes(range(256)) * 200  # 51,200 bytes: three whole pieces and a part
    piecewise = in_pieces(send)

    async def write() -> None:
        await piecewise({"type": "http.response.start", "status": 200, "headers": []})
        await piecewise({"type": "http.response.body", "body": body, "more_body": False})
        await piecewise({"type": "http.response.body", "body": b"tail", "more_body": False})

    anyio.run(write)
    pieces = sent[1:-1]
    assert sent[0]["type"] == "http.response.start"
    assert [len(p["body"]) for p in pieces] == [WRITE_PIECE_BYTES] * 3 + [51_200 - 3 * 16_384]  # type: ignore[arg-type]
    assert b"".join(p["body"] for p in pieces) == body  # type: ignore[misc]
    # Only the last piece of a body that ends says so; a small body goes as it came.
    assert [p["more_body"] for p in pieces] == [True, True, True, False]
    assert sent[-1] == {"type": "http.response.body", "body": b"tail", "more_body": False}


def test_a_large_answer_arrives_whole_through_a_small_send_buffer(serve: ServeFactory) -> None:
    # ``tokenbelt serve`` fixes each connection's send buffer (SO_SNDBUF 32 KiB); a 1 MB
    # non-streamed answer goes out in pieces and arrives byte for byte.
    script = words(64, 16_384)
    served = serve(scripted_runtime(ScriptedEngine(script, delay=0)), sndbuf=32 * 1024)
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(stream=False, max_tokens=len(script)))
        status, headers = client.read_head()
        size = int(headers["content-length"])
        while len(client.buffer) < size and client.fill():
            pass
        body = json.loads(bytes(client.buffer[:size]))
    assert (status, len(client.buffer)) == (200, size)
    assert body["choices"][0]["message"]["content"] == "".join(script)
    served.assert_released(served.recorder.nth(0), EndReason.STOP)
