"""ASGI responses that race the body against the client's disconnect.

Both listen on the ASGI ``receive`` channel in a task group beside the writer
(as starlette's ``StreamingResponse`` did before ASGI 2.4): the moment the client
goes away, the request is cancelled with ``client_disconnect``, whether it is
queued, in prefill or decoding. Nothing polls per token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.types import Receive, Scope, Send

from ..belt import EndReason
from ..runtime import Stream
from ._errors import compact_json


async def _listen_for_disconnect(
    receive: Receive, stream: Stream, scope: anyio.CancelScope
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.cancel(EndReason.CLIENT_DISCONNECT)
            scope.cancel()
            return


def _headers(pairs: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in pairs.items()]


class EventStreamResponse:
    """Server-sent events from an async iterator of JSON-able events.

    ``events`` yields dicts (sent as ``data: {json}``) and finally the string
    ``"[DONE]"``. Writing waits for the socket (uvicorn's flow control), so a
    reader that stops reading stops pulling from the belt, which pauses the model.
    """

    def __init__(
        self, stream: Stream, events: AsyncIterator[object], headers: dict[str, str]
    ) -> None:
        self.stream = stream
        self.events = events
        self.headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
            **headers,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def write(group: anyio.abc.TaskGroup) -> None:
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": _headers(self.headers),
                    }
                )
                async for event in self.events:
                    data = event if isinstance(event, str) else compact_json(event)
                    await send(
                        {
                            "type": "http.response.body",
                            "body": f"data: {data}\n\n".encode(),
                            "more_body": True,
                        }
                    )
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                self.stream.cancel(EndReason.CLIENT_DISCONNECT)
            finally:
                group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_listen_for_disconnect, receive, self.stream, group.cancel_scope)
                await write(group)
        finally:
            # Whatever ended the response, the model must not keep generating.
            self.stream.cancel(EndReason.CLIENT_DISCONNECT)


class DeferredResponse:
    """A non-streaming answer computed while listening for the client's disconnect.

    ``compute`` reads the stream to its end and returns the ASGI response to send.
    """

    def __init__(
        self,
        stream: Stream,
        compute: Callable[[], Awaitable[Callable[[Scope, Receive, Send], Awaitable[None]]]],
    ) -> None:
        self.stream = stream
        self.compute = compute

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_listen_for_disconnect, receive, self.stream, group.cancel_scope)
                response = await self.compute()
                group.cancel_scope.cancel()
        finally:
            self.stream.cancel(EndReason.CLIENT_DISCONNECT)
        if response is not None:
            await response(scope, receive, send)
