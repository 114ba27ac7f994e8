"""tokenbelt's own routes, the same whichever dialect a request came in: health, metrics, requests.

``/health`` (and its ``live``/``ready`` pair) for probes, ``/metrics`` for Prometheus,
``/v1/requests`` for the traces of recent requests and ``POST
/v1/requests/{id}/cancel`` to stop one (end reason ``user_cancel``). With API keys, a
caller sees and cancels only its own requests (the admin key: all of them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Query
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ...belt import EndReason
from ._errors import error_response
from ._middleware import CALLER
from ._path import Serving

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
    workers = {name: dataclasses.asdict(w) for name, w in state.workers().items()}
    if workers:  # models in worker processes: pid, memory, restarts, last crash
        body["workers"] = workers
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(path: Serving) -> Response:
    path.state.metrics.refresh_gauges()
    registry = path.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _not_found(request_id: str) -> JSONResponse:
    return error_response(
        404, f"no request {request_id!r}", "invalid_request_error", "request_not_found"
    )


@router.post("/v1/requests/{request_id}/cancel", summary="Stop a request (end reason user_cancel)")
async def cancel(request_id: str, path: Serving) -> JSONResponse:
    # With API keys, a request made with another key answers as an unknown one.
    stream = path.state.active(request_id, CALLER.get())
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
