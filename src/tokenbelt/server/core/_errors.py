"""Error bodies in each API's own shape, and the one place that picks HTTP status codes.

Routes and handlers speak in OpenAI terms (a status, a message, a type, a code); an
``ErrorShape`` turns that into the body of the API the request came in on. Which
shape a path answers in is a ``Dialects`` lookup by path prefix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from ... import _errors as errors
from ._missing import missing


class UnsupportedParameter(errors.InvalidArgument):
    """A request used a parameter tokenbelt does not support; answered 400, never ignored."""

    def __init__(self, param: str, why: str = "tokenbelt does not support it") -> None:
        super().__init__(f"unsupported parameter {param!r}: {why}", param=param)


#: tells the ``openai`` SDK (and others that read it) not to send the request again: the
#: server stopped that work on purpose (a deadline, a shutdown), a retry would repeat it
NO_RETRY = {"x-should-retry": "false"}

#: (status, message, type, code, param) -> (status, body) in one API's shape
ErrorShape = Callable[[int, str, str, str | None, str | None], tuple[int, dict[str, Any]]]


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def openai_shape(
    status: int, message: str, type_: str, code: str | None, param: str | None
) -> tuple[int, dict[str, Any]]:
    """The OpenAI API's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return status, error_body(message, type_, code, param)


class Dialects:
    """Which error shape each API answers in, by path prefix (the longest match wins)."""

    def __init__(self) -> None:
        self._shapes: list[tuple[str, ErrorShape]] = []

    def add(self, prefix: str, shape: ErrorShape) -> None:
        self._shapes.append((prefix, shape))
        self._shapes.sort(key=lambda item: len(item[0]), reverse=True)

    def shape_for(self, path: str) -> ErrorShape:
        for prefix, shape in self._shapes:
            if path.startswith(prefix):
                return shape
        return openai_shape


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    shape: ErrorShape = openai_shape,
) -> JSONResponse:
    status, body = shape(status, message, type_, code, param)
    if extra:
        body.update(extra)
    return JSONResponse(body, status_code=status, headers=headers)


def response_for(
    exc: errors.TokenbeltError, retry_after_s: int = 1, shape: ErrorShape = openai_shape
) -> JSONResponse:
    """Map a tokenbelt error to its HTTP answer."""
    answer = partial(error_response, shape=shape)
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(exc, errors.QueueFull):
        return answer(429, str(exc), "rate_limit_error", "queue_full", headers=retry)
    if isinstance(exc, errors.ModelLoading):
        return answer(503, str(exc), "service_unavailable", "model_loading", headers=retry)
    if isinstance(exc, errors.ModelLoadError):
        return answer(503, str(exc), "service_unavailable", "model_load_failed", param="model")
    if isinstance(exc, errors.RuntimeClosed):
        return answer(
            503, str(exc), "service_unavailable", "shutting_down", headers={**retry, **NO_RETRY}
        )
    if isinstance(exc, errors.UnknownModel):
        return answer(404, str(exc), "invalid_request_error", "model_not_found", param="model")
    if isinstance(exc, errors.PromptTooLong):
        return answer(400, str(exc), "invalid_request_error", "context_length_exceeded")
    if isinstance(exc, UnsupportedParameter):
        return answer(
            400, str(exc), "invalid_request_error", "unsupported_parameter", param=exc.param
        )
    if isinstance(exc, errors.InvalidArgument):
        return answer(400, str(exc), "invalid_request_error", "invalid_value", param=exc.param)
    return answer(500, str(exc), "server_error", "internal_error")


def failure(exc: BaseException) -> tuple[int, str, str]:
    """(status, type, code) for an engine's failure during generation.

    An upstream's 4xx passes through with its status; any other upstream failure is a
    502; anything else a 500.
    """
    if isinstance(exc, errors.UpstreamError):
        if exc.status is not None and 400 <= exc.status < 500:
            return exc.status, "invalid_request_error", f"upstream_{exc.status}"
        return 502, "upstream_error", "upstream_error"
    return 500, "server_error", "runtime_error"


_BRANCHES = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _branch(part: object) -> bool:
    """A step of a location that names a union's branch, not a field (``list[...]``)."""
    text = str(part)
    return text in _BRANCHES or "[" in text


def _where(err: Any) -> str:
    """The field an error is about; a bad tag of a union names the tag's field."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _branch(p)]
    if err.get("type") == "union_tag_invalid":
        loc.append(str(err.get("ctx", {}).get("discriminator", "")).strip("'"))
    return ".".join(loc)


def _describe(errors: list[Any]) -> str:
    parts = []
    for err in errors[:5]:
        loc = _where(err)
        # pydantic's "Extra inputs are not permitted" does not say what the user needs to hear.
        msg = "unsupported parameter" if err.get("type") == "extra_forbidden" else err.get("msg")
        parts.append(f"{loc or 'body'}: {msg or 'invalid'}")
    return "; ".join(parts)


def install(app: FastAPI, dialects: Dialects) -> None:
    """Make every error a JSON body in the shape of the API its path belongs to."""

    def shape(request: Request) -> ErrorShape:
        return dialects.shape_for(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors) or any(
            tuple(e.get("loc", ())) == ("body",) for e in errors
        ):
            return error_response(
                400,
                "the body must be a JSON object, sent as Content-Type: application/json",
                "invalid_request_error",
                "invalid_json",
                shape=shape(request),
            )
        # The deepest first: of a union's branches, the one that got furthest says most.
        errors.sort(key=lambda e: -len(e.get("loc", ())))
        first = errors[0] if errors else {}
        param = _where(first) or None
        # 400 as OpenAI answers a bad body (its SDK raises ``BadRequestError``), not 422.
        return error_response(
            400,
            _describe(errors),
            "invalid_request_error",
            "invalid_body",
            param=param,
            shape=shape(request),
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route: say which
            status, message = missing(request.method, request.url.path)
            code = "not_implemented" if status == 501 else "route_not_found"
            return error_response(
                status, message, "invalid_request_error", code, shape=shape(request)
            )
        if exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
            return error_response(
                405,
                message,
                "invalid_request_error",
                "method_not_allowed",
                headers=dict(exc.headers) if exc.headers else None,
                shape=shape(request),
            )
        return error_response(
            exc.status_code,
            str(exc.detail),
            "invalid_request_error",
            getattr(exc, "code", None),
            headers=dict(exc.headers) if exc.headers else None,
            shape=shape(request),
        )

    @app.exception_handler(errors.TokenbeltError)
    async def tokenbelt_error(request: Request, exc: errors.TokenbeltError) -> JSONResponse:
        retry_after_s = request.app.state.tokenbelt.settings.retry_after_s
        return response_for(exc, retry_after_s, shape(request))


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
