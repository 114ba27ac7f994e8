"""tokenbelt's own routes, the same whichever dialect a request came in: health, metrics, requests.

``/health`` (and its ``live``/``ready`` pair) for probes, ``/metrics`` for Prometheus,
``/v1/requests`` for the traces of recent requests and ``POST
/v1/requests/{id}/cancel`` to stop one (end reason ``user_cancel``). With API keys, a
caller sees and cancels only its own requests (the admin key: all of them). Server-wide
settings change only under ``/v1/admin`` (the admin key, or a server without keys).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import anyio
from fastapi import APIRouter, Query, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..._errors import IllegalState
from ...belt import EndReason
from ...runtime import Stream
from ._errors import UnsupportedParameter, error_response, note_refusal
from ._middleware import CALLER
from ._path import Serving
from ._private import public

#: tokenbelt's own routes, one module-level router (the serving core comes as ``Serving``)
router = APIRouter()


@router.get("/health/live", summary="Liveness: 200 while the process serves HTTP")
async def live() -> dict[str, Any]:
    return {"status": "alive"}


@router.get("/health/ready", summary="Readiness: 200 when every model takes requests")
@router.get("/health", summary="Readiness (the same as /health/ready)")
async def health(path: Serving) -> JSONResponse:
    state = path.state
    status, reason = state.readiness()
    body: dict[str, Any] = {
        "status": status,
        "reason": reason,
        "models": {name: m.state.value for name, m in state.runtime.models.items()},
        "loads": {a: s.to_dict() for a, s in state.loads.items()},
        # /v1/responses keeps nothing unless the server was given a store
        "responses_store": {
            "enabled": state.settings.responses_store_bytes > 0,
            "budget_bytes": state.settings.responses_store_bytes,
            "ttl_s": state.settings.responses_ttl_s,
        },
    }
    # Each model's place: loaded or not and why, memory, slots, pin, keep-alive.
    statuses = state.model_statuses()
    body["model_status"] = {s.name: s.to_dict() for s in statuses}
    body["memory"] = state.memory(statuses)
    workers = {name: dataclasses.asdict(w) for name, w in state.workers().items()}
    if workers:  # models in worker processes: pid, memory, restarts, last crash
        body["workers"] = workers
    code = 200 if status == "ok" else 503
    if state.settings.keys() and CALLER.get() is None:
        # A probe needs the verdict only; pids, memory and crash text are for key holders.
        body = {"status": status, "models": body["models"], "details": "send an API key"}
    # A failed load's error names the file: its name only, unless the admin key asked.
    return JSONResponse(public(body), status_code=code)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(path: Serving) -> Response:
    path.state.metrics.refresh_gauges(path.state.recent(path.state.settings.recent_requests))
    registry = path.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _not_found(request_id: str) -> JSONResponse:
    return error_response(
        404, f"no request {request_id!r}", "invalid_request_error", "request_not_found"
    )


#: how long a cancel waits for a request that is submitted but not yet handed to the state
HANDOVER_WAIT_S = 2.0


async def _running(path: Serving, request_id: str) -> Stream | None:
    """The running stream of ``request_id``. One submitted a moment ago is waited for: its
    trace is enqueued (and it may be decoding) on the submit's thread before the event
    loop hands the stream to the state, and a cancel in between answered "not cancelled"
    while the request ran on."""
    caller = CALLER.get()
    waited = time.monotonic() + HANDOVER_WAIT_S
    while (stream := path.state.active(request_id, caller)) is None:
        trace = path.state.trace(request_id, caller)
        if trace is None or trace.released is not None or time.monotonic() > waited:
            return None
        await anyio.sleep(0.001)
    return stream


@router.post("/v1/requests/{request_id}/cancel", summary="Stop a request (end reason user_cancel)")
async def cancel(request_id: str, path: Serving) -> JSONResponse:
    # With API keys, a request made with another key answers as an unknown one.
    stream = await _running(path, request_id)
    if stream is None:
        trace = path.state.trace(request_id, CALLER.get())
        if trace is None:
            return _not_found(request_id)
        reason = trace.end_reason.value if trace.end_reason else None
        return JSONResponse({"id": request_id, "cancelled": False, "end_reason": reason})
    cancelled = stream.cancel(EndReason.USER_CANCEL)
    reason = stream.end_reason.value if stream.end_reason else None
    return JSONResponse({"id": request_id, "cancelled": cancelled, "end_reason": reason})


@router.get(
    "/v1/requests",
    summary="Recent requests, newest first, with their traces (with API keys: the "
    "caller's own; the admin key's: all)",
)
async def recent(path: Serving, limit: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
    traces = path.state.recent(limit, CALLER.get())
    return {"object": "list", "data": [t.to_dict() for t in traces]}


@router.get("/v1/requests/{request_id}", summary="One request's trace")
async def one(request_id: str, path: Serving) -> JSONResponse:
    trace = path.state.trace(request_id, CALLER.get())
    if trace is None:
        return _not_found(request_id)
    return JSONResponse(trace.to_dict())


class KeepAliveSetting(BaseModel):
    """The server-wide keep-alive of one model: seconds it stays loaded once idle."""

    model_config = ConfigDict(extra="forbid", strict=True)

    keep_alive: float | None = Field(
        description="seconds the model stays loaded once idle (null: for ever; 0: unloaded "
        "as soon as it is idle), for every request that gives no keep_alive of its own"
    )


@router.post(
    "/v1/admin/models/{model_id:path}/keep_alive",
    summary="Set a model's server-wide keep-alive (the admin key, or a server without keys)",
)
async def set_keep_alive(
    model_id: str, body: KeepAliveSetting, path: Serving, request: Request
) -> JSONResponse:
    """The one way to change the server's keep-alive: a request's own ``keep_alive``
    (Ollama's) holds for that request only. Blocking off the loop: ``0`` unloads an idle
    model before the answer."""
    caller = CALLER.get()
    if caller is not None and not caller.admin:
        note_refusal(request.scope, "admin_only")
        return error_response(
            403,
            "only the admin key may change a server-wide setting",
            "permission_error",
            "admin_only",
        )
    model = path.state.model_for(model_id)
    try:
        await anyio.to_thread.run_sync(model.set_keep_alive, body.keep_alive)
    except IllegalState as exc:  # engines given ready-made: it cannot be loaded again
        raise UnsupportedParameter("keep_alive", str(exc)) from None
    return JSONResponse({"model": model.name, "keep_alive": model.keep_alive})
