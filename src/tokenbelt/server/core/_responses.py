"""ASGI responses that race the body against the client's disconnect.

Both listen on the ASGI ``receive`` channel in a task group beside the writer
(as starlette's ``StreamingResponse`` did before ASGI 2.4): the moment the client
goes away, ``stop`` is called (for a generation: cancel with ``client_disconnect``,
whether it is queued, in prefill or decoding). Nothing polls per token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import anyio
import orjson
from starlette.types import Message, Receive, Scope, Send

from ...belt import EndReason
from ...runtime import Stream
from ._h11 import ABORT_EXTENSION

#: what a response calls when its client goes away (and whenever it ends, to be sure)
Stop = Callable[[], object]
#: what an SSE stream writes when it has had nothing to send for a while: a comment line,
#: which every SSE parser skips (Anthropic's dialect sends its own ``ping`` event)
SSE_KEEPALIVE = b": keepalive\n\n"
#: turns one event of a body into the bytes written for it
Encode = Callable[[object], bytes]


def disconnect(stream: Stream) -> Stop:
    """The ``stop`` of a generation: cancel it with ``client_disconnect``."""
    return partial(stream.cancel, EndReason.CLIENT_DISCONNECT)


def reader_gone(stream: Stream) -> Stop:
    """The ``stop`` of a stream whose reader accepts nothing: ``reader_timeout``."""
    return partial(stream.cancel, EndReason.READER_TIMEOUT)


def event_json(value: object) -> bytes:
    """One streamed event's JSON, compact (orjson: a few times faster than ``json`` on a
    token's chunk, which every dialect writes once a token; text as UTF-8, a non-finite
    number as ``null``)."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def sse(event: object) -> bytes:
    """One server-sent event: ``data: {json}`` (a string is sent as it is)."""
    if isinstance(event, str):
        return f"data: {event}\n\n".encode()
    return b"data: " + event_json(event) + b"\n\n"


def named_sse(name: str, data: object) -> bytes:
    """One named server-sent event: ``event: <name>`` and ``data: {json}``."""
    return b"event: " + name.encode() + b"\ndata: " + event_json(data) + b"\n\n"


def ndjson(event: object) -> bytes:
    """One JSON object on one line."""
    return event_json(event) + b"\n"


async def _listen_for_disconnect(receive: Receive, stop: Stop, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stop()
            scope.cancel()
            return


class _ReaderGone(Exception):
    """A write waited longer than the reader timeout."""


def _abort(scope: Scope) -> None:
    connection = scope.get("extensions", {}).get(ABORT_EXTENSION)
    if connection is not None:
        connection["abort"]()


def _headers(pairs: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in pairs.items()]


class EventStreamResponse:
    """A streamed body from an async iterator of events, each written as ``encode`` says.

    By default server-sent events: ``events`` yields dicts (sent as ``data: {json}``)
    and finally the string ``"[DONE]"``; ``ndjson`` with its media type gives one JSON
    object per line. Writing waits for the socket (uvicorn's flow control), so a
    reader that stops reading stops pulling from the belt, which pauses the model.

    With ``reader_timeout``, a write the socket has not taken after that many seconds
    calls ``gone`` (for a generation: ``reader_timeout``) and closes the connection
    through the server's ``tokenbelt.connection`` abort extension where it has one.

    With ``keepalive`` (seconds, bytes), a stream that has had no event for that long
    (a long prompt's prefill, a queue) writes those bytes, so that a client whose
    HTTP stack gives up on a silent body (Node's undici does after 300 s) keeps
    waiting. The next event is awaited all along: nothing is cancelled or restarted.
    """

    def __init__(
        self,
        stop: Stop,
        events: AsyncIterator[object],
        headers: dict[str, str],
        *,
        encode: Encode = sse,
        media_type: str = "text/event-stream; charset=utf-8",
        reader_timeout: float | None = None,
        gone: Stop | None = None,
        keepalive: tuple[float, bytes] | None = None,
    ) -> None:
        self.stop = stop
        self.keepalive = keepalive
        self.gone = gone or stop
        self.reader_timeout = reader_timeout
        self.events = events
        self.encode = encode
        self.headers = {
            "content-type": media_type,
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
            **headers,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # asyncio's lock takes an uncontended acquire without yielding (anyio's checkpoints
        # there), so a token's write costs no extra turn of the event loop.
        lock = asyncio.Lock()
        finished = anyio.Event()
        last = time.monotonic()  # of the last write

        async def timed_send(message: Message) -> None:
            try:
                async with asyncio.timeout(self.reader_timeout):
                    await send(message)
            except TimeoutError:
                raise _ReaderGone from None

        async def write(group: anyio.abc.TaskGroup) -> None:
            nonlocal last
            try:
                await timed_send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": _headers(self.headers),
                    }
                )
                async for event in self.events:
                    body = self.encode(event)
                    async with lock:
                        await timed_send(
                            {"type": "http.response.body", "body": body, "more_body": True}
                        )
                        last = time.monotonic()
                async with lock:
                    finished.set()
                    await timed_send(
                        {"type": "http.response.body", "body": b"", "more_body": False}
                    )
            except _ReaderGone:
                self.gone()
                _abort(scope)
            except OSError:
                self.stop()
            finally:
                group.cancel_scope.cancel()

        async def keep_alive(group: anyio.abc.TaskGroup, every: float, ping: bytes) -> None:
            # Beside the writer, not around it: each event goes out as it comes, and
            # only a silence as long as ``every`` gets a ping between two of them.
            nonlocal last
            try:
                while not finished.is_set():
                    await anyio.sleep(max(0.0, last + every - time.monotonic()))
                    async with lock:
                        if finished.is_set() or time.monotonic() - last < every:
                            continue
                        await timed_send(
                            {"type": "http.response.body", "body": ping, "more_body": True}
                        )
                        last = time.monotonic()
            except _ReaderGone:
                self.gone()
                _abort(scope)
                group.cancel_scope.cancel()
            except OSError:
                self.stop()
                group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_listen_for_disconnect, receive, self.stop, group.cancel_scope)
                if self.keepalive is not None:
                    group.start_soon(keep_alive, group, *self.keepalive)
                await write(group)
        finally:
            # Whatever ended the response, the model must not keep generating; and the
            # dialect's generator ends now (its cleanup runs: a stored response is kept),
            # not whenever the garbage collector finds it.
            self.stop()
            close = getattr(self.events, "aclose", None)
            if close is not None:
                await close()


class DeferredResponse:
    """A non-streaming answer computed while listening for the client's disconnect.

    ``compute`` reads the stream to its end and returns the ASGI response to send.
    """

    def __init__(
        self,
        stop: Stop,
        compute: Callable[[], Awaitable[Callable[[Scope, Receive, Send], Awaitable[None]]]],
    ) -> None:
        self.stop = stop
        self.compute = compute

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_listen_for_disconnect, receive, self.stop, group.cancel_scope)
                response = await self.compute()
                group.cancel_scope.cancel()
        finally:
            self.stop()
        if response is not None:
            await response(scope, receive, send)
