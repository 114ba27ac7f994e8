"""The OpenAPI document: every status each route answers, with its API's error body.

FastAPI documents a 200 and its own 422 for each route; the server answers more (a
refused Host, a missing key, a full queue, a deadline...) and writes validation errors
as 400s. ``install`` rewrites the document once, from rules that follow the layers
that answer: the middleware (every route), the body parser (routes with a body or
parameters) and the request path (routes that generate).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from . import anthropic, ollama
from .core import PROTECTED

#: the routes that submit a generation (admission, deadlines, engine failures)
GENERATING = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/api/chat",
        "/api/generate",
        "/v1/embeddings",
        "/v1/rerank",
        "/rerank",
        "/api/embed",
        "/api/embeddings",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        anthropic.PREFIX,
    }
)

_WHY = {
    400: "Invalid request: a malformed body, a bad value or an unsupported parameter",
    401: "A valid API key is required (when the server has one)",
    404: "No such model or request",
    413: "The body is over the server's limit",
    421: "The Host header names no host this server answers to",
    429: "The admission queue is full (see Retry-After)",
    500: "The engine failed",
    502: "The upstream serving this model failed",
    503: "The model is loading (see Retry-After) or the server is shutting down",
    504: "A deadline the request carried passed (the exact end reason is in tokenbelt)",
    507: "The model cannot fit the server's memory budget, now or ever (the reason says)",
}

_STRING_OR_NULL = {"anyOf": [{"type": "string"}, {"type": "null"}]}

SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": _STRING_OR_NULL,
                    "code": _STRING_OR_NULL,
                },
            }
        },
    },
    "OllamaError": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}


def error_schema(path: str) -> str:
    """The name of the error body ``path`` answers with (as ``Dialects`` chooses it)."""
    if path.startswith(anthropic.PREFIX):
        return "AnthropicError"
    if path.startswith(ollama.PREFIX):
        return "OllamaError"
    return "OpenAIError"


def statuses(path: str, operation: dict[str, Any]) -> set[int]:
    """The error statuses ``operation`` on ``path`` may answer."""
    found = {421}
    if path.startswith(PROTECTED):
        found.add(401)
    if "requestBody" in operation:
        found |= {400, 413}
    if operation.get("parameters"):
        found.add(400)
    if "{" in path or operation.get("requestBody"):
        found.add(404)  # a path's id, or a body's model
    if path in GENERATING:
        found |= {429, 500, 502, 503, 504, 507}
    if path == "/health":
        found.add(503)
    return found


#: one server-sent event, as clients parse it: each field a line of the event
_SSE_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
_STREAMED: dict[str, dict[str, Any]] = {"text/event-stream": _SSE_EVENT}


def streamed_as(path: str) -> str | None:
    """The media type of ``path``'s streamed 200 (``stream: true``), if it streams."""
    if path in ("/api/chat", "/api/generate", "/api/pull"):
        return "application/x-ndjson"
    if path in GENERATING:
        return "text/event-stream"
    return None


def _rewrite(document: dict[str, Any]) -> dict[str, Any]:
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components.update(SCHEMAS)
    for path, operations in document.get("paths", {}).items():
        ref = {"$ref": f"#/components/schemas/{error_schema(path)}"}
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            streamed = streamed_as(path)
            if streamed is not None and "200" in responses:
                content = responses["200"].setdefault("content", {})
                schema = _STREAMED.get(streamed, {"type": "string"})
                content.setdefault(streamed, {"schema": schema})
            for status in sorted(statuses(path, operation)):
                responses.setdefault(
                    str(status),
                    {"description": _WHY[status], "content": {"application/json": {"schema": ref}}},
                )
    return document


def install(app: FastAPI) -> None:
    """Serve the rewritten document at ``/openapi.json`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _rewrite(
                get_openapi(
                    title=app.title,
                    version=app.version,
                    summary=app.summary,
                    routes=app.routes,
                )
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
