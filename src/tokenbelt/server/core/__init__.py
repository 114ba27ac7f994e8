"""The serving core every dialect shares; it imports no dialect.

- ``_path``: the request path (submit, stream, answer) and the ``Serving`` dependency
  through which each route is given it;
- ``_responses``: the SSE/NDJSON writer and the deferred answer, raced against the
  client's disconnect;
- ``_options``: tokenbelt's own request options, and the sampling ranges (``ranges``);
- ``_tools``: tool calls for the dialects that are not OpenAI's (``plan_tools``,
  ``Calls``);
- ``_control``: tokenbelt's own routes (health, metrics, ``/v1/requests``, cancel);
- ``_state``, ``_errors``, ``_middleware``, ``_metrics``, ``_h11`` (uvicorn's h11
  protocol, kept in bounds) and ``_shutdown``.
"""

from . import _options as ranges
from ._control import router as control_router
from ._errors import (
    NO_RETRY,
    Dialects,
    ErrorShape,
    UnsupportedParameter,
    compact_json,
    error_body,
    error_response,
    failure,
    install,
    openai_shape,
    response_for,
)
from ._h11 import http_protocol
from ._middleware import (
    CALLER,
    PROTECTED,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HostMiddleware,
    JsonBodyMiddleware,
    RequestIdMiddleware,
)
from ._options import MAX_TIMEOUT_S, TokenbeltOptions
from ._path import RELEASE_WAIT_S, Asgi, RequestPath, Serving, Submitted, tokenbelt_final
from ._responses import DeferredResponse, EventStreamResponse, named_sse, ndjson, sse
from ._shutdown import GracefulServer
from ._state import ServerSettings, ServerState
from ._tools import Calls, ToolPlan, plan_tools

__all__ = [
    "CALLER",
    "MAX_TIMEOUT_S",
    "NO_RETRY",
    "PROTECTED",
    "RELEASE_WAIT_S",
    "ApiKeyMiddleware",
    "Asgi",
    "BodyLimitMiddleware",
    "Calls",
    "DeferredResponse",
    "Dialects",
    "ErrorShape",
    "EventStreamResponse",
    "GracefulServer",
    "HostMiddleware",
    "JsonBodyMiddleware",
    "RequestIdMiddleware",
    "RequestPath",
    "ServerSettings",
    "ServerState",
    "Serving",
    "Submitted",
    "TokenbeltOptions",
    "ToolPlan",
    "UnsupportedParameter",
    "compact_json",
    "control_router",
    "error_body",
    "error_response",
    "failure",
    "http_protocol",
    "install",
    "named_sse",
    "ndjson",
    "openai_shape",
    "plan_tools",
    "ranges",
    "response_for",
    "sse",
    "tokenbelt_final",
]
