"""OpenAI-style error bodies, and the one place that picks HTTP status codes."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from .._errors import (
    InvalidArgument,
    ModelLoading,
    PromptTooLong,
    QueueFull,
    RuntimeClosed,
    TokenbeltError,
    UnknownModel,
    UpstreamError,
)


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    body = error_body(message, type_, code, param)
    if extra:
        body.update(extra)
    return JSONResponse(body, status_code=status, headers=headers)


def response_for(exc: TokenbeltError, retry_after_s: int = 1) -> JSONResponse:
    """Map a tokenbelt error to its HTTP answer."""
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(exc, QueueFull):
        return error_response(429, str(exc), "rate_limit_error", "queue_full", headers=retry)
    if isinstance(exc, ModelLoading):
        return error_response(503, str(exc), "service_unavailable", "model_loading", headers=retry)
    if isinstance(exc, RuntimeClosed):
        return error_response(503, str(exc), "service_unavailable", "shutting_down")
    if isinstance(exc, UnknownModel):
        return error_response(
            404, str(exc), "invalid_request_error", "model_not_found", param="model"
        )
    if isinstance(exc, PromptTooLong):
        return error_response(400, str(exc), "invalid_request_error", "context_length_exceeded")
    if isinstance(exc, InvalidArgument):
        return error_response(400, str(exc), "invalid_request_error", "invalid_value")
    return error_response(500, str(exc), "server_error", "internal_error")


def failure(exc: BaseException) -> tuple[int, str, str]:
    """(status, type, code) for an engine's failure during generation.

    An upstream's 4xx passes through with its status; any other upstream failure is a
    502; anything else a 500.
    """
    if isinstance(exc, UpstreamError):
        if exc.status is not None and 400 <= exc.status < 500:
            return exc.status, "invalid_request_error", f"upstream_{exc.status}"
        return 502, "upstream_error", "upstream_error"
    return 500, "server_error", "runtime_error"


def _describe(errors: list[Any]) -> str:
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def install(app: FastAPI) -> None:
    """Make every error an OpenAI-style JSON body."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors) or any(
            tuple(e.get("loc", ())) == ("body",) for e in errors
        ):
            return error_response(
                400, "the body must be a JSON object", "invalid_request_error", "invalid_json"
            )
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(
            422, _describe(errors), "invalid_request_error", "invalid_body", param=param
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            exc.status_code,
            str(exc.detail),
            "invalid_request_error",
            getattr(exc, "code", None),
            headers=dict(exc.headers) if exc.headers else None,
        )

    @app.exception_handler(TokenbeltError)
    async def tokenbelt_error(request: Request, exc: TokenbeltError) -> JSONResponse:
        return response_for(exc, request.app.state.tokenbelt.settings.retry_after_s)


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
