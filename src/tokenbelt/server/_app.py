"""The HTTP service: the OpenAI-compatible routes, and the Ollama and Anthropic ones beside them.

Routes translate and hold no generation logic: ``RequestPath`` (``_serving``) does the
rest for every API.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Header, Query
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response

from .. import __version__
from .._errors import InvalidArgument
from ..belt import EndReason
from ..engines import GenerationRequest, Message
from ..runtime import Model, Runtime, Stream, sampling_from
from . import _anthropic, _anthropic_schemas, _errors, _ollama, _ollama_schemas, _openapi
from ._errors import Dialects, error_response
from ._middleware import (
    CALLER,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HostMiddleware,
    RequestIdMiddleware,
)
from ._schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from ._serving import RELEASE_WAIT_S, RequestPath, tokenbelt_final
from ._state import ServerSettings, ServerState

STATIC = Path(__file__).parent / "static"
API = "openai"
#: a caller's own request id (a front tokenbelt passes its id on to its upstream)
_REQUEST_ID = Header(
    None,
    alias="x-request-id",
    description="use this request id (letters, digits, ._:-, at most 64) if it is new",
)


def _messages(body: ChatCompletionRequest) -> tuple[Message, ...]:
    return tuple({"role": m.role, "content": m.content} for m in body.messages)


def _prompt(body: CompletionRequest) -> str:
    if isinstance(body.prompt, str):
        return body.prompt
    if len(body.prompt) != 1:
        raise InvalidArgument("prompt must be one string (a list must hold exactly one)")
    return body.prompt[0]


def _model_entry(name: str, **tokenbelt: Any) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "tokenbelt",
        "tokenbelt": tokenbelt,
    }


def create_app(
    runtime: Runtime,
    settings: ServerSettings | None = None,
    *,
    load: str | None = None,
    load_options: dict[str, Any] | None = None,
    close_runtime: bool = True,
) -> FastAPI:
    """Build the app over ``runtime``; with ``load``, that alias loads in the background.

    Leaving the app's lifespan closes the runtime (``shutdown`` for every request)
    unless ``close_runtime`` is False.
    """
    settings = settings or ServerSettings()
    state = ServerState(runtime, settings)
    path = RequestPath(state)
    dialects = Dialects()
    dialects.add(_ollama.PREFIX, _ollama_schemas.error_shape)
    dialects.add(_anthropic.PREFIX, _anthropic_schemas.error_shape)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if load is not None:
            state.load_in_background(load, **(load_options or {}))
        yield
        if close_runtime:
            await anyio.to_thread.run_sync(runtime.close)

    app = FastAPI(
        title="tokenbelt",
        version=__version__,
        summary="A local OpenAI-compatible LLM service whose stops reach the decode loop.",
        lifespan=lifespan,
    )
    app.state.tokenbelt = state
    _errors.install(app, dialects)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes, dialects=dialects)
    if settings.keys():
        app.add_middleware(
            ApiKeyMiddleware, keys=settings.keys(), dialects=dialects, admin=settings.admin_key
        )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
            expose_headers=["x-request-id", "x-tokenbelt-trace"],
        )
    app.add_middleware(HostMiddleware, allowed=settings.allowed_hosts, dialects=dialects)
    # Outside every other layer, starlette's own 500 answer included.
    build = app.build_middleware_stack

    def with_request_ids() -> RequestIdMiddleware:
        return RequestIdMiddleware(build(), state.request_id_from)

    app.build_middleware_stack = with_request_ids  # type: ignore[method-assign]
    if STATIC.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # -- pages and probes ---------------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        page = STATIC / "index.html"
        if not page.is_file():
            return JSONResponse({"tokenbelt": __version__, "docs": "/docs"})
        return FileResponse(page)

    @app.get("/health", summary="Liveness and model readiness")
    async def health() -> dict[str, Any]:
        models = {name: m.state.value for name, m in runtime.models.items()}
        loads = {a: s.to_dict() for a, s in state.loads.items()}
        ready = bool(models) and all(v == "ready" for v in models.values())
        return {"status": "ok" if ready else "loading", "models": models, "loads": loads}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        state.metrics.refresh_gauges()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", summary="Models: loaded, loading, and the catalog's aliases")
    async def list_models() -> dict[str, Any]:
        loaded = runtime.models
        catalog = {c["alias"]: c for c in await anyio.to_thread.run_sync(state.catalog)}
        data = []
        for name in state.model_names():
            model = loaded.get(name)
            status = state.loads.get(name)
            data.append(
                _model_entry(
                    name,
                    loaded=model is not None,
                    cached=True,
                    state=model.state.value if model else (status.state if status else None),
                    load=status.to_dict() if status else None,
                    context_length=model.context_length if model else None,
                    slots=model.statistics().slots if model else None,
                    info=model.info if model else {},
                )
            )
        known = {d["id"] for d in data}
        for alias, entry in catalog.items():
            if alias not in known:
                data.append(
                    _model_entry(
                        alias,
                        loaded=False,
                        cached=entry["cached"],
                        state="available",
                        load={"state": "available", "error": None, "elapsed_s": 0.0},
                        context_length=entry["context_length"],
                        slots=None,
                        info={},
                    )
                )
        return {"object": "list", "data": data}

    # -- requests ----------------------------------------------------------------------------

    async def _submit(
        model: Model, body: _Sampling, request: GenerationRequest, request_id: str | None
    ) -> Stream:
        submitted = await path.submit(
            model, request, body.tokenbelt, api=API, request_id=request_id
        )
        return submitted.stream

    async def _events(
        stream: Stream, model: str, obj: str, include_usage: bool, chat: bool
    ) -> AsyncIterator[object]:
        base = {"id": stream.request_id, "object": obj, "created": int(time.time()), "model": model}
        first = True
        error: str | None = None
        failed: BaseException | None = None
        try:
            async for piece in stream:
                if chat:
                    delta: dict[str, Any] = {"content": piece}
                    if first:
                        delta["role"] = "assistant"
                    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": piece, "finish_reason": None}
                first = False
                stats = stream.statistics()
                yield {
                    **base,
                    "choices": [choice],
                    "tokenbelt": {
                        "buffered": stats.buffered,
                        "capacity": stats.capacity,
                        "completion_tokens": stream.trace.completion_tokens,
                    },
                }
        except Exception as exc:  # the engine failed: say so in the stream, then end it
            failed = exc
            error = f"{type(exc).__name__}: {exc}"
        await stream.await_released(RELEASE_WAIT_S)
        reason = stream.end_reason or EndReason.RUNTIME_ERROR
        last: dict[str, Any] = {"index": 0, "finish_reason": reason.openai_finish_reason}
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        final: dict[str, Any] = {**base, "choices": [last], "tokenbelt": tokenbelt_final(stream)}
        if error is not None and failed is not None:
            _status, type_, code = _errors.failure(failed)
            final["error"] = _errors.error_body(error, type_, code)["error"]
        yield final
        if include_usage:
            yield {**base, "choices": [], "usage": stream.usage.to_dict()}
        yield "[DONE]"

    def _respond(stream: Stream, body: _Sampling, model: Model, chat: bool) -> Response:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            obj = "chat.completion.chunk" if chat else "text_completion"
            events = _events(stream, model.name, obj, include_usage, chat)
            return path.streaming(stream, events)

        def render(s: Stream) -> dict[str, Any]:
            reason = s.end_reason or EndReason.RUNTIME_ERROR
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": s.text},
                    "finish_reason": reason.openai_finish_reason,
                }
            else:
                choice = {"index": 0, "text": s.text, "finish_reason": reason.openai_finish_reason}
            return {
                "id": s.request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model.name,
                "choices": [choice],
                "usage": s.usage.to_dict(),
                "tokenbelt": tokenbelt_final(s),
            }

        return path.answer(stream, render, shape=_errors.openai_shape)

    @app.post("/v1/chat/completions", summary="Chat completion (streaming with stream=true)")
    async def chat_completions(
        body: ChatCompletionRequest, x_request_id: str | None = _REQUEST_ID
    ) -> Response:
        model = state.model_for(body.model)
        request = GenerationRequest(
            messages=_messages(body), sampling=sampling_from(body.sampling())
        )
        stream = await _submit(model, body, request, x_request_id)
        return _respond(stream, body, model, chat=True)

    @app.post("/v1/completions", summary="Text completion from a raw prompt")
    async def completions(
        body: CompletionRequest, x_request_id: str | None = _REQUEST_ID
    ) -> Response:
        model = state.model_for(body.model)
        request = GenerationRequest(prompt=_prompt(body), sampling=sampling_from(body.sampling()))
        stream = await _submit(model, body, request, x_request_id)
        return _respond(stream, body, model, chat=False)

    @app.post("/v1/requests/{request_id}/cancel", summary="Stop a request (end reason user_cancel)")
    async def cancel(request_id: str) -> JSONResponse:
        # With API keys, a request made with another key answers as an unknown one.
        stream = state.active(request_id, CALLER.get())
        if stream is None:
            trace = state.trace(request_id, CALLER.get())
            if trace is None:
                return error_response(
                    404, f"no request {request_id!r}", "invalid_request_error", "request_not_found"
                )
            reason = trace.end_reason.value if trace.end_reason else None
            return JSONResponse({"id": request_id, "cancelled": False, "end_reason": reason})
        cancelled = stream.cancel(EndReason.USER_CANCEL)
        reason = stream.end_reason.value if stream.end_reason else None
        return JSONResponse({"id": request_id, "cancelled": cancelled, "end_reason": reason})

    @app.get(
        "/v1/requests",
        summary="Recent requests, newest first, with their traces (with API keys: the "
        "caller's own; the admin key's: all)",
    )
    async def recent(limit: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
        traces = state.recent(limit, CALLER.get())
        return {"object": "list", "data": [t.to_dict() for t in traces]}

    @app.get("/v1/requests/{request_id}", summary="One request's trace")
    async def one(request_id: str) -> JSONResponse:
        trace = state.trace(request_id, CALLER.get())
        if trace is None:
            return error_response(
                404, f"no request {request_id!r}", "invalid_request_error", "request_not_found"
            )
        return JSONResponse(trace.to_dict())

    app.include_router(_ollama.router(state, path))
    app.include_router(_anthropic.router(state, path))
    _openapi.install(app)
    return app
