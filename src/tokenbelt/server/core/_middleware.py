"""Plain ASGI middleware: a request id on every answer, a Host allow-list, a body size
limit and an API key check.

Their refusals are written in the error shape of the API the path belongs to.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...belt import new_request_id
from ...engines.remote import error_message
from ._errors import REFUSAL, Dialects, note_refusal
from ._metrics import request_log

#: the API paths (the web page, its assets and /health stay open)
PROTECTED = ("/v1", "/api/", "/metrics")


async def _reject(
    send: Send, scope: Scope, dialects: Dialects, status: int, message: str, type_: str, code: str
) -> None:
    note_refusal(scope, code)
    shape = dialects.shape_for(scope.get("path", ""))
    status, payload = shape(status, message, type_, code, None)
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        dialects: Dialects | None = None,
        larger: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.dialects = dialects or Dialects()
        #: path prefix -> its own limit (uploads: ``/v1/audio/``)
        self.larger = larger or {}

    def _limit_for(self, path: str) -> int:
        for prefix, limit in self.larger.items():
            if path.startswith(prefix):
                return limit
        return self.limit

    async def _too_large(self, send: Send, scope: Scope) -> None:
        await _reject(
            send,
            scope,
            self.dialects,
            413,
            f"the body is over {self._limit_for(scope.get('path', ''))} bytes",
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
            if size > self._limit_for(scope.get("path", "")):
                await self._too_large(send, scope)
                return
        limit = self._limit_for(scope.get("path", ""))
        received = 0
        started = False

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
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


def bearer_token(authorization: bytes) -> bytes:
    """The credentials of an ``Authorization: Bearer ...`` header (the scheme in any case)."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


@dataclass(frozen=True)
class Caller:
    """Who made a request, by the key it came with (never the key itself)."""

    identity: str
    #: the admin key: every request is visible to it
    admin: bool = False


#: the id ``RequestIdMiddleware`` gave the request being served
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tokenbelt_request_id", default=None
)
#: the caller of the request being served (set by ``ApiKeyMiddleware``; None: no keys)
CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "tokenbelt_caller", default=None
)


def _identity(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ApiKeyMiddleware:
    """Require an API key on the APIs (not on ``/health`` or the page).

    It may come as ``Authorization: Bearer <key>`` (OpenAI, Ollama; the scheme is
    case-insensitive) or as ``x-api-key: <key>`` (Anthropic); either is accepted on
    every API. Each key is a caller of its own (``CALLER`` while the request is
    served); the ``admin`` key, if any, is an admin caller.
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        dialects: Dialects | None = None,
        admin: str | None = None,
    ) -> None:
        self.app = app
        self.keys = [(k.encode(), Caller(_identity(k), admin=k == admin)) for k in keys]
        self.dialects = dialects or Dialects()

    def _caller(self, scope: Scope) -> Caller | None:
        headers = dict(scope.get("headers", ()))
        bearer = bearer_token(headers.get(b"authorization", b""))
        given = headers.get(b"x-api-key", b"")
        found = None
        # Every comparison always runs: how long a refusal takes says nothing about a key.
        for key, caller in self.keys:
            if hmac.compare_digest(bearer, key) | hmac.compare_digest(given, key):
                found = caller
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        caller = self._caller(scope)
        if scope["type"] == "http" and path.startswith(PROTECTED) and caller is None:
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
        token = CALLER.set(caller)
        try:
            await self.app(scope, receive, send)
        finally:
            CALLER.reset(token)


#: Content-Types that curl (``-d``) and some clients send with a JSON body
_LOOSE_TYPES = (b"", b"application/x-www-form-urlencoded", b"text/plain")


class JsonBodyMiddleware:
    """Read a body sent without a JSON Content-Type as JSON, unless a browser sent it.

    ``curl -d`` (Ollama's own examples) says ``application/x-www-form-urlencoded`` and
    some clients (litellm's Ollama provider) send none; FastAPI reads such bodies as
    JSON only under ``application/json``. A browser always sends ``Origin`` with a
    POST, and those types are the ones a page may send to another site without asking
    first (a CORS "simple request"): from a browser they stay refused, so a page the
    user visits cannot start generations on this machine's service.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # DELETE too: Ollama documents ``curl -X DELETE /api/delete -d '{"model": ...}'``
        # (a browser's DELETE is never a "simple request": it is asked about first).
        if scope["type"] == "http" and scope.get("method") in ("POST", "PUT", "PATCH", "DELETE"):
            headers = scope.get("headers", [])
            given = b""
            origin = False
            for name, value in headers:
                if name == b"content-type":
                    given = value.split(b";", 1)[0].strip().lower()
                elif name == b"origin":
                    origin = True
            if given in _LOOSE_TYPES and not origin:
                kept = [(n, v) for n, v in headers if n != b"content-type"]
                scope = {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def host_name(host: str) -> str:
    """``host`` without its port: ``localhost:8080`` -> ``localhost``, ``[::1]:80`` -> ``[::1]``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostMiddleware:
    """Serve only requests whose ``Host`` names this server (``"*"`` allows any).

    A page on another site that rebinds its DNS name to 127.0.0.1 reaches the server
    with its own name in ``Host``: it is refused with 421 before any route runs.
    """

    def __init__(
        self, app: ASGIApp, allowed: tuple[str, ...], dialects: Dialects | None = None
    ) -> None:
        self.app = app
        self.allowed = frozenset(host_name(h) for h in allowed)
        self.dialects = dialects or Dialects()

    def _allowed(self, scope: Scope) -> bool:
        if "*" in self.allowed:
            return True
        host = dict(scope.get("headers", ())).get(b"host")
        return host is not None and host_name(host.decode("latin-1")) in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self._allowed(scope):
            await _reject(
                send,
                scope,
                self.dialects,
                421,
                "this server does not answer to that Host name (see tokenbelt serve "
                "--allowed-host)",
                "invalid_request_error",
                "host_not_allowed",
            )
            return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Give every answer an ``x-request-id``, whatever answered it.

    The caller's own id (``x-request-id``) is used when ``claim`` accepts it (well-formed
    and new), else a new one; either way the request goes on carrying that id, so a
    generation's trace, a refusal (429, 401, 413...) and the answer all name the same id.
    An answer that sets its own ``x-request-id`` keeps it. An ``X-Tokenbelt-Supersede``
    header is the request's supersede key (``SUPERSEDE``) on every API.
    """

    def __init__(self, app: ASGIApp, claim: Callable[[str | None], str | None]) -> None:
        self.app = app
        self.claim = claim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"x-request-id"]
        given = dict(scope.get("headers", ())).get(b"x-request-id")
        request_id = self.claim(given.decode("latin-1") if given else None) or new_request_id()
        headers.append((b"x-request-id", request_id.encode()))

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = list(message.get("headers", ()))
                if not any(k.lower() == b"x-request-id" for k, _ in out):
                    out.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": out}
            await send(message)

        key = dict(scope.get("headers", ())).get(b"x-tokenbelt-supersede")
        supersede = key.decode("latin-1").strip() if key else None
        token = REQUEST_ID.set(request_id)
        keyed = SUPERSEDE.set(supersede or None)
        try:
            await self.app({**scope, "headers": headers}, receive, with_id)
        finally:
            SUPERSEDE.reset(keyed)
            REQUEST_ID.reset(token)


#: the supersede key of the request being served, from its ``X-Tokenbelt-Supersede``
#: header (set by ``RequestIdMiddleware``; None: no header)
SUPERSEDE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tokenbelt_supersede", default=None
)


class RefusalMiddleware:
    """Count every refused request (a 4xx answer, or a 503 given before any work) by route,
    status and reason: the field that was refused, or the refusal's code.

    ``refused(route, status, reason)`` is called once per refusal; the route is the
    route's path template (``unmatched`` for a path no route serves), so the series stay
    bounded whatever paths clients send.
    """

    def __init__(
        self,
        app: ASGIApp,
        refused: Callable[[str, int, str], None],
        routes: Callable[[], list[Any]],
    ) -> None:
        self.app = app
        self.refused = refused
        self.routes = routes

    def _route(self, scope: Scope) -> str:
        """The path template of the route the router chose (``scope["route"]``), else of
        the first whose template matches the path (a refusal before routing)."""
        templates = list(_templates(self.routes()))
        chosen = scope.get("route")
        found = next((t for t, route in templates if route is chosen), None)
        if found is None:
            path = str(scope.get("path", ""))
            found = next((t for t, _ in templates if compile_path(t)[0].match(path)), None)
        return found or "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holder: list[str | None] = [None]
        scope[REFUSAL] = holder
        refusal: dict[str, Any] = {}
        body = bytearray()

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if 400 <= status < 500 or (status == 503 and holder[0] is not None):
                    route, reason = self._route(scope), holder[0] or f"http_{status}"
                    self.refused(route, status, reason)
                    refusal.update(route=route, status=status, reason=reason)
            elif refusal and message["type"] == "http.response.body":
                body.extend(message.get("body", b"")[: _LOGGED_BODY - len(body)])
                if not message.get("more_body", False):
                    _log_refusal(scope, refusal, bytes(body))
                    refusal.clear()
            await send(message)

        await self.app(scope, receive, watch)


#: how much of a refusal's body is read for its message
_LOGGED_BODY = 4096


def _log_refusal(scope: Scope, refusal: dict[str, Any], body: bytes) -> None:
    """One JSON line on ``tokenbelt.requests`` for a refused request, beside the lines of
    the requests that ran: the operator sees why a client was turned away, in the words
    the client was given."""
    line = {
        "event": "refused",
        "request_id": REQUEST_ID.get(),
        "method": scope.get("method"),
        **refusal,
        "message": _message(body),
    }
    request_log.info("%s", json.dumps(line))


def _message(body: bytes) -> str:
    """The message of an error body in any dialect's shape, as the remote engine reads an
    upstream's (the body's text, shortened, when it is not JSON)."""
    try:
        return error_message(json.loads(body))
    except ValueError:
        return error_message(body.decode("utf-8", "replace"))


def _templates(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every route with its whole path template, the routes of included routers among
    them: FastAPI keeps an included router whole, as one route, and a router included
    in a router with a prefix (Ollama's ``/api``) keeps its routes' own paths."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            context = getattr(route, "include_context", None)
            yield from _templates(list(inner.routes), prefix + getattr(context, "prefix", ""))
        elif isinstance(getattr(route, "path", None), str):
            yield prefix + route.path, route
