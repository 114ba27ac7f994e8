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
from starlette.types import Scope

from ... import _errors as errors
from ...engines import NO_LEVELS_ADVICE, NO_PHASE_ADVICE
from ._missing import missing
from ._options import range_of


class NotHere(errors.InvalidArgument):
    """A thing a request names by id that is not here: a 404 whose ``code`` says which
    (``response_not_found``), counted under that code."""

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.code = code


class UnsupportedParameter(errors.InvalidArgument):
    """A request used a parameter tokenbelt does not support; answered 400, never ignored."""

    def __init__(self, param: str, why: str = "tokenbelt does not support it") -> None:
        super().__init__(f"unsupported parameter {param!r}: {why}", param=param)


def think_said_as(exc: errors.InvalidArgument, off: str) -> str:
    """The engine's refusal of a ``think`` in the words of a route whose field turns
    thinking off with ``off`` (``'none'``, ``{"type": "disabled"}``): its ``think: ``
    prefix goes, and its advice names that field's values, not the SDK's booleans."""
    text = str(exc).removeprefix("think: ")
    text = text.replace(NO_PHASE_ADVICE, f"send {off} or leave it out")
    return text.replace(NO_LEVELS_ADVICE, f"leave it out or send {off}")


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
    return _answer_for(exc, retry_after_s, shape, str(exc))[0]


def _answer_for(
    exc: errors.TokenbeltError, retry_after_s: int, shape: ErrorShape, text: str
) -> tuple[JSONResponse, str]:
    """The HTTP answer to a tokenbelt error (saying ``text``), and its code."""
    answer = partial(error_response, shape=shape)
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(exc, errors.QueueFull):
        code = "queue_full"
        return answer(429, text, "rate_limit_error", code, headers=retry), code
    if isinstance(exc, errors.ModelLoading):
        code = "model_loading"
        return answer(503, text, "service_unavailable", code, headers=retry), code
    if isinstance(exc, errors.OverBudget):
        if exc.transient:  # busy models hold the memory: a later request may fit
            code = "memory_budget_busy"
            return answer(503, text, "service_unavailable", code, headers=retry), code
        code = "memory_budget"
        return answer(507, text, "insufficient_storage", code, param="model"), code
    if isinstance(exc, errors.ModelLoadError):
        code = "model_load_failed"
        return answer(503, text, "service_unavailable", code, param="model"), code
    if isinstance(exc, errors.RuntimeClosed):
        code = "shutting_down"
        head = {**retry, **NO_RETRY}
        return answer(503, text, "service_unavailable", code, headers=head), code
    if isinstance(exc, errors.UnknownModel):
        code = "model_not_found"
        return answer(404, text, "invalid_request_error", code, param="model"), code
    if isinstance(exc, errors.ModelError):
        # Known, but its file cannot be had (not downloaded and the hub out of reach, a
        # checksum that does not match): an immediate retry would only download again.
        code = "model_unavailable"
        head = {**retry, **NO_RETRY}
        return answer(503, text, "service_unavailable", code, param="model", headers=head), code
    if isinstance(exc, errors.PromptTooLong):
        code = "context_length_exceeded"
        return answer(400, text, "invalid_request_error", code), code
    if isinstance(exc, NotHere):
        return answer(404, text, "invalid_request_error", exc.code, param=exc.param), exc.code
    if isinstance(exc, UnsupportedParameter):
        code = "unsupported_parameter"
        return answer(400, text, "invalid_request_error", code, param=exc.param), code
    if isinstance(exc, errors.InvalidArgument):
        code = "invalid_value"
        return answer(400, text, "invalid_request_error", code, param=exc.param), code
    return answer(500, text, "server_error", "internal_error"), "internal_error"


#: the scope key of a refused request's reason (a one-item list, shared by the scope's copies)
REFUSAL = "tokenbelt.refusal"


def note_refusal(scope: Scope, reason: str) -> None:
    """Say why this request is refused (the field, or the refusal's code), for the metric
    ``RefusalMiddleware`` keeps."""
    holder = scope.get(REFUSAL)
    if holder is not None:
        holder[0] = reason


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
    # ``constrained-str`` and its kin: a branch whose type carries constraints
    return text in _BRANCHES or "[" in text or text.startswith("constrained-")


def _where(err: Any) -> str:
    """The field an error is about; a bad tag of a union names the tag's field."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _branch(p)]
    if err.get("type") == "union_tag_invalid":
        loc.append(str(err.get("ctx", {}).get("discriminator", "")).strip("'"))
    return ".".join(loc)


#: pydantic's error types for a number past a bound
_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _split(err: Any) -> tuple[tuple[str, ...], str | None]:
    """An error's field (its location before any union branch) and its first branch."""
    loc = [str(p) for p in err.get("loc", ())]
    for i, part in enumerate(loc):
        if _branch(part):
            return tuple(loc[:i]), part
    return tuple(loc), None


def _furthest_branch(errors: list[Any]) -> list[Any]:
    """Of a union field's errors, only the branch that got furthest: a list of items
    that fails inside an item is not also "input: Input should be a valid string"."""
    depth: dict[tuple[str, ...], dict[str, int]] = {}
    for err in errors:
        where, branch = _split(err)
        if branch is not None:
            seen = depth.setdefault(where, {})
            seen[branch] = max(seen.get(branch, 0), len(err.get("loc", ())))
    kept = []
    for err in errors:
        where, branch = _split(err)
        seen = depth.get(where, {})
        if branch is None or len(seen) < 2 or seen[branch] == max(seen.values()):
            kept.append(err)
    return kept


def _describe(errors: list[Any]) -> str:
    parts = []
    for err in _furthest_branch(errors)[:20]:  # every bad field at once, within reason
        loc = _where(err)
        # pydantic's "Extra inputs are not permitted" does not say what the user needs to hear.
        msg = "unsupported parameter" if err.get("type") == "extra_forbidden" else err.get("msg")
        if err.get("type") == "value_error":  # a validator's own words, without pydantic's prefix
            msg = str(msg).removeprefix("Value error, ")
        limits = range_of(loc.rsplit(".", 1)[-1]) if err.get("type") in _BOUNDS else None
        if limits is not None:  # the whole range, as the SDK and the CLI say it
            msg = f"must be {limits.text()}, got {err.get('input')!r}"
        parts.append(f"{loc or 'body'}: {msg or 'invalid'}")
    return "; ".join(parts)


def install(app: FastAPI, dialects: Dialects, clean: Callable[[str], str] = str) -> None:
    """Make every error a JSON body in the shape of the API its path belongs to; a
    tokenbelt error's message goes through ``clean`` (the server's: no absolute path)."""

    def shape(request: Request) -> ErrorShape:
        return dialects.shape_for(request.url.path)

    def refused(request: Request, response: JSONResponse, reason: str | None) -> JSONResponse:
        if reason:
            note_refusal(request.scope, reason)
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors) or any(
            tuple(e.get("loc", ())) == ("body",) for e in errors
        ):
            return refused(
                request,
                error_response(
                    400,
                    "the body must be a JSON object, sent as Content-Type: application/json",
                    "invalid_request_error",
                    "invalid_json",
                    shape=shape(request),
                ),
                "invalid_json",
            )
        unicode = [e for e in errors if e.get("type") == "string_unicode"]
        if unicode:  # a lone surrogate: strict string fields refuse it before tokenbelt does
            field = _where(unicode[0]).split(".")[0] or "body"
            answer = error_response(
                400,
                f"{field} is not valid Unicode (a lone surrogate)",
                "invalid_request_error",
                "invalid_value",
                param=field,
                shape=shape(request),
            )
            return refused(request, answer, field)
        # The deepest first: of a union's branches, the one that got furthest says most.
        errors.sort(key=lambda e: -len(e.get("loc", ())))
        first = errors[0] if errors else {}
        param = _where(first) or None
        # 400 as OpenAI answers a bad body (its SDK raises ``BadRequestError``), not 422.
        answer = error_response(
            400,
            _describe(errors),
            "invalid_request_error",
            "invalid_body",
            param=param,
            shape=shape(request),
        )
        return refused(request, answer, param or "invalid_body")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route: say which
            status, message = missing(request.method, request.url.path)
            code = "not_implemented" if status == 501 else "route_not_found"
            # A 501 is a 5xx that a retry cannot mend: the SDKs retry 5xx unless told not to.
            answer = error_response(
                status,
                message,
                "invalid_request_error",
                code,
                headers=NO_RETRY if status == 501 else None,
                shape=shape(request),
            )
            return refused(request, answer, code)
        if exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
            note_refusal(request.scope, "method_not_allowed")
            return error_response(
                405,
                message,
                "invalid_request_error",
                "method_not_allowed",
                headers=dict(exc.headers) if exc.headers else None,
                shape=shape(request),
            )
        note_refusal(request.scope, getattr(exc, "code", None) or f"http_{exc.status_code}")
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
        answer, code = _answer_for(exc, retry_after_s, shape(request), clean(str(exc)))
        if answer.status_code < 500 or answer.status_code == 503:  # refused, not failed
            # A bad field is counted by its name; a thing not here by what it is.
            field = None if isinstance(exc, NotHere) else getattr(exc, "param", None)
            note_refusal(request.scope, field or code)
        return answer


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
