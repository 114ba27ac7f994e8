"""Plain ASGI middleware: a body size limit and an API key check."""

from __future__ import annotations

import hmac
import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


async def _reject(send: Send, status: int, message: str, type_: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
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

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def _too_large(self, send: Send) -> None:
        await _reject(
            send,
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
                    send, 400, "bad Content-Length", "invalid_request_error", "bad_request"
                )
                return
            if size > self.limit:
                await self._too_large(send)
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
                await self._too_large(send)


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on the API (not on ``/health`` or the page)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path == "/metrics"):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _reject(
                    send,
                    401,
                    "a valid API key is required (Authorization: Bearer ...)",
                    "authentication_error",
                    "invalid_api_key",
                )
                return
        await self.app(scope, receive, send)
