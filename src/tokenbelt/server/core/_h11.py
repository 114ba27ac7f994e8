"""uvicorn's HTTP/1.1 protocol (h11) with the edges of a connection kept in bounds.

- **Read deadline.** Each request's head and body must arrive within ``read_timeout``
  seconds of the connection opening (or of the previous answer ending). A connection
  that sends half a request, or nothing, is answered 408 (when a request was begun)
  and closed; uvicorn alone would hold it for ever.
- **Half-close.** A client that shuts down its sending side after a complete request
  (``shutdown(SHUT_WR)``, as some proxies do) is answered. asyncio closes a transport
  at EOF unless the protocol asks otherwise, and uvicorn reported that as a disconnect.
  A client that closed its socket sends the same EOF, so the server probes: an interim
  ``100 Continue`` (every HTTP/1.1 client reads and skips one) goes out at once; a
  closed socket answers it with a reset, which the socket's error state shows within
  ``HALF_CLOSED_POLL_S``, and that ends the request as a disconnect. An EOF after the
  answer has begun is a disconnect, as before.
- **Bytes in flight.** The transport's write buffer pauses the writer above
  ``WRITE_BUFFER_HIGH`` bytes (asyncio's default is 64 KiB).
- **Large bodies in pieces.** A body message over ``WRITE_PIECE_BYTES`` is written as
  pieces of that size, each waiting for the transport (``in_pieces``). ``tokenbelt
  serve`` fixes each connection's send buffer at 64 KiB so that a reader that stops
  pauses generation early; on loopback, whose segments are 64 KiB, one large write
  then left a single segment in flight, which the client acknowledges only when its
  delayed-ACK timer fires (40 ms): a 3.7 MB embedding answer took 1.7 s to arrive
  (2.2 MB/s), in 16 KiB pieces 5 ms.
- **Abort.** Each request's scope carries the ASGI extension ``tokenbelt.connection``
  with ``abort()``: a response that gives up on its reader (``reader_timeout``) closes
  the connection at once, without waiting on the socket it gave up on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

import h11
from starlette.types import Message, Send
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from ...belt import new_request_id

logger = logging.getLogger("tokenbelt.server")

#: the transport pauses the response writer above this many buffered bytes
WRITE_BUFFER_HIGH = 16 * 1024
#: the largest piece of a body written at once (see "Large bodies in pieces")
WRITE_PIECE_BYTES = 16 * 1024
#: how often a half-closed connection's socket is checked for a reset
HALF_CLOSED_POLL_S = 0.1
#: the ASGI scope extension that lets a response close its connection
ABORT_EXTENSION = "tokenbelt.connection"


def _error_answer(status: int, phrase: str, message: str, code: str) -> bytes:
    """A whole error answer, OpenAI-shaped, for a connection about to be closed."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"x-request-id: {new_request_id()}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


def in_pieces(send: Send) -> Send:
    """``send``, with a body message over ``WRITE_PIECE_BYTES`` sent as pieces of that
    size (in order, each awaited, the last one carrying the message's ``more_body``)."""

    async def send_in_pieces(message: Message) -> None:
        body = message.get("body", b"") if message["type"] == "http.response.body" else b""
        if len(body) <= WRITE_PIECE_BYTES:
            await send(message)
            return
        more = bool(message.get("more_body", False))
        view = memoryview(body)
        for start in range(0, len(body), WRITE_PIECE_BYTES):
            end = start + WRITE_PIECE_BYTES
            piece = bytes(view[start:end])
            await send(
                {"type": "http.response.body", "body": piece, "more_body": more or end < len(body)}
            )

    return send_in_pieces


class GuardedH11Protocol(H11Protocol):
    """An ``H11Protocol`` with a read deadline, half-close support and an abort hook.

    Build one with ``http_protocol(read_timeout)``; the class attribute is the default.
    """

    #: seconds for a request's head and body to arrive (None: no limit)
    read_timeout: float | None = 30.0

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._half_closed_watch: asyncio.TimerHandle | None = None
        self._half_closed = False
        inner = self.app

        async def app(scope: Any, receive: Any, send: Any) -> None:
            scope.setdefault("extensions", {})[ABORT_EXTENSION] = {"abort": self._abort}
            await inner(scope, receive, in_pieces(send))

        self.app = app

    # -- connection events ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm_read_deadline()  # the whole request is in

    def on_response_complete(self) -> None:
        if self._half_closed:
            # The client sends nothing more: this connection has served its request.
            self.transport.close()
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_read_deadline()  # for the next request on this connection

    def eof_received(self) -> bool | None:  # type: ignore[override]
        cycle = self.cycle
        if cycle is None or cycle.response_started or self.conn.their_state is not h11.DONE:
            # Nothing to answer, half a request, or an EOF while the answer is being
            # written (a client that read the head and left): close, a disconnect.
            return None
        self._half_closed = True
        cycle.keep_alive = False
        # The probe: a closed socket answers these bytes with a reset.
        probe = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
        self.transport.write(self.conn.send(probe))
        cycle.waiting_for_100_continue = False
        self._watch_half_closed()
        return True  # keep the transport open for the answer

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP: an OpenAI-shaped 400 (uvicorn's own is plain text)."""
        self.transport.write(_error_answer(400, "Bad Request", msg, "bad_request"))
        self.transport.close()

    # -- internals -----------------------------------------------------------------------------

    def _abort(self) -> None:
        self.transport.abort()

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        if self.read_timeout is not None:
            self._read_deadline = self.loop.call_later(self.read_timeout, self._read_too_slow)

    def _disarm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _disarm(self) -> None:
        self._disarm_read_deadline()
        if self._half_closed_watch is not None:
            self._half_closed_watch.cancel()
            self._half_closed_watch = None

    def _read_too_slow(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is not h11.IDLE and state is not h11.SEND_BODY:
            return
        begun = state is h11.SEND_BODY or bool(self.conn.trailing_data[0])
        if begun and (self.cycle is None or not self.cycle.response_started):
            logger.info("closing a connection whose request did not arrive in time")
            message = f"the request was not received within {self.read_timeout:g} s"
            answer = _error_answer(408, "Request Timeout", message, "request_timeout")
            self.transport.write(answer)
        self.transport.close()

    def _watch_half_closed(self) -> None:
        self._half_closed_watch = None
        if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
            return
        if self._was_reset():
            self.transport.abort()  # a disconnect: the response's listener stops the request
            return
        self._half_closed_watch = self.loop.call_later(HALF_CLOSED_POLL_S, self._watch_half_closed)

    def _was_reset(self) -> bool:
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        except OSError:
            return True


def http_protocol(read_timeout: float | None) -> type[GuardedH11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout": read_timeout})
