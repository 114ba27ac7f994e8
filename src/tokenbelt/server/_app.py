"""The HTTP service, assembled: settings, state, middleware, lifespan, each dialect's router.

Nothing here answers a request. The serving core (``core``) holds what every API
shares, ``RequestPath`` and tokenbelt's own routes among it; each dialect (``openai``,
``responses``, ``ollama``, ``anthropic``) is a folder with a module-level router, included here.
Adding a dialect means adding a folder and one ``include_router``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from starlette.responses import FileResponse, JSONResponse, Response

from .. import __version__
from ..runtime import Runtime
from . import _openapi, anthropic, llamacpp, ollama, openai, responses
from .core import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    Dialects,
    HostMiddleware,
    JsonBodyMiddleware,
    RefusalMiddleware,
    RequestIdMiddleware,
    RequestPath,
    ServerSettings,
    ServerState,
    control_router,
    install,
    scrub,
)

STATIC = Path(__file__).parent / "static"


async def index() -> Response:
    """The web page (or, without its assets, where the API's documentation is)."""
    page = STATIC / "index.html"
    if not page.is_file():
        return JSONResponse({"tokenbelt": __version__, "docs": "/docs"})
    return FileResponse(page)


def _add_middleware(app: FastAPI, settings: ServerSettings, state: ServerState) -> None:
    dialects = Dialects()
    dialects.add(ollama.PREFIX, ollama.error_shape)
    dialects.add(anthropic.PREFIX, anthropic.error_shape)
    # The error handlers, each dialect's shape by its prefix; no path in a message.
    install(app, dialects, clean=scrub)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(
        BodyLimitMiddleware,
        limit=settings.max_body_bytes,
        dialects=dialects,
        larger={"/v1/audio/": settings.max_audio_bytes},
    )
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
        counted = RefusalMiddleware(build(), state.metrics.refused, lambda: app.router.routes)
        return RequestIdMiddleware(counted, state.request_id_from)

    app.build_middleware_stack = with_request_ids  # type: ignore[method-assign]


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
    app.state.tokenbelt_path = RequestPath(state)
    memory = responses.Responses(
        responses.Store(settings.responses_store_bytes, settings.responses_ttl_s)
    )
    app.state.tokenbelt_responses = memory
    state.metrics.registry.register(memory.collector())
    _add_middleware(app, settings, state)
    if STATIC.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC), name="static")
    # HEAD too: clients check that a server is there with ``HEAD /`` (Ollama's CLI,
    # Claude Code) and Ollama answers it 200.
    app.add_api_route("/", index, methods=["GET", "HEAD"], include_in_schema=False)
    app.include_router(control_router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(ollama.router)
    app.include_router(anthropic.router)
    app.include_router(llamacpp.router)
    _openapi.install(app)
    _build_routes(app)
    return app


def _build_routes(app: FastAPI) -> None:
    """Have FastAPI build every route's parameters now, on the thread that makes the app.

    FastAPI builds them at a route's first request, making pydantic schemas of the
    dialects' shared body types; two servers in one process (an application's, a test's
    upstream and front) could then build the same type on two threads at once, which
    pydantic does not survive (a 500, ``__pydantic_core_schema__``). Matching any path
    builds every route of each included router."""
    scope = {"type": "http", "path": "/", "root_path": "", "method": "GET", "headers": []}
    for route in app.router.routes:
        route.matches(scope)
