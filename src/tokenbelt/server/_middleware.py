"""Plain ASGI middleware: a body size limit and an API key check.

Their refusals are written in the error shape of the API the path belongs to.
"""

from __future__ import annotations

import hmac
import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import Dialects

#: the API paths (the web page, its assets and /health stay open)
PROTECTED = ("/v1", "/api/", "/metrics")


async def _reject(
    send: Send, scope: Scope, dialects: Dialects, status: int, message: str, type_: str, code: str
) -> None:
    shape = dialects.shape_for(scope.get("path", ""))
    status, payload = shape(status, message, type_, code, None)
    body = json.dumps(payload)
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed (chunked) body passes the limit.

    An ``HTTPException`` because FastAPI's body parsing lets only those through: it
    turns any other error raised while reading into a 400. The app's handler then
    answers 413 with ``code``.
    """

    code = "body_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the body is over {limit} bytes")


class BodyLimitMiddleware:
    """Answer 413 to a body over ``limit`` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int, dialects: Dialects | None = None) -> None:
        self.app = app
        self.limit = limit
        self.dialects = dialects or Dialects()

    async def _too_large(self, send: Send, scope: Scope) -> None:
        await _reject(
            send,
            scope,
            self.dialects,
            413,
            f"the body is over {self.limit} bytes",
            "invalid_request_error",
            "body_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _reject(
                    send,
                    scope,
                    self.dialects,
                    400,
                    "bad Content-Length",
                    "invalid_request_error",
                    "bad_request",
                )
                return
            if size > self.limit:
                await self._too_large(send, scope)
                return
        received = 0
        started = False

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited, watch)
        except BodyTooLarge:  # a reader without an HTTPException handler
            if not started:
                await self._too_large(send, scope)


class ApiKeyMiddleware:
    """Require the API key on the APIs (not on ``/health`` or the page).

    It may come as ``Authorization: Bearer <key>`` (OpenAI, Ollama) or as
    ``x-api-key: <key>`` (Anthropic); either is accepted on every API.
    """

    def __init__(self, app: ASGIApp, api_key: str, dialects: Dialects | None = None) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()
        self.dialects = dialects or Dialects()

    def _allowed(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers", ()))
        # Both comparisons always run: how long a refusal takes says nothing about the key.
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
        key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
        return bearer or key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(PROTECTED) and not self._allowed(scope):
            await _reject(
                send,
                scope,
                self.dialects,
                401,
                "a valid API key is required (Authorization: Bearer ... or x-api-key)",
                "authentication_error",
                "invalid_api_key",
            )
            return
        await self.app(scope, receive, send)
