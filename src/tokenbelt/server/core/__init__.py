"""The serving core every dialect shares; it imports no dialect.

- ``_path``: the request path (submit, stream, answer), ``until_end`` (a streamed body
  that ends with its dialect's terminal events, whatever the end) and the ``Serving``
  dependency through which each route is given it;
- ``_responses``: the SSE/NDJSON writer and the deferred answer, raced against the
  client's disconnect;
- ``_options``: tokenbelt's own request options, and the sampling ranges (``ranges``);
- ``_fit``: a long chat fitted to the context window by leaving its oldest turns out
  (Ollama's chat, the Responses API's ``truncation: "auto"``);
- ``_tools``: tool calls for the dialects that are not OpenAI's (``plan_tools``,
  ``Calls``);
- ``_control``: tokenbelt's own routes (health, metrics, ``/v1/requests``, cancel);
- ``_state``, ``_errors``, ``_middleware``, ``_metrics``, ``_h11`` (uvicorn's h11
  protocol, kept in bounds) and ``_shutdown``.
"""

from . import _options as ranges
from ._control import router as control_router
from ._embed import (
    answer_embedding,
    check_dimensions,
    encode_vector,
    shrink,
    submit_embedding,
)
from ._errors import (
    NO_RETRY,
    Dialects,
    ErrorShape,
    NotHere,
    UnsupportedParameter,
    compact_json,
    error_body,
    error_response,
    failure,
    install,
    openai_shape,
    response_for,
    think_said_as,
)
from ._files import file_text
from ._fit import Fit
from ._h11 import WRITE_PIECE_BYTES, http_protocol, in_pieces
from ._middleware import (
    CALLER,
    PROTECTED,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HostMiddleware,
    JsonBodyMiddleware,
    RefusalMiddleware,
    RequestIdMiddleware,
)
from ._options import MAX_TIMEOUT_S, TokenbeltOptions
from ._path import (
    RELEASE_WAIT_S,
    Asgi,
    RequestPath,
    Serving,
    StreamEnd,
    Submitted,
    tokenbelt_final,
    until_end,
)
from ._private import admin_asked, public, scrub
from ._progress import prompt_progress, with_progress
from ._responses import DeferredResponse, EventStreamResponse, named_sse, ndjson, sse
from ._shutdown import GracefulServer
from ._state import ServerSettings, ServerState
from ._tools import Calls, ToolPlan, plan_tools
from ._transcribe import (
    OPENAI_SPEECH_NAMES,
    answer_transcription,
    speech_model_for,
    stream_transcription,
    submit_transcription,
)

__all__ = [
    "CALLER",
    "MAX_TIMEOUT_S",
    "NO_RETRY",
    "OPENAI_SPEECH_NAMES",
    "PROTECTED",
    "RELEASE_WAIT_S",
    "WRITE_PIECE_BYTES",
    "ApiKeyMiddleware",
    "Asgi",
    "BodyLimitMiddleware",
    "Calls",
    "DeferredResponse",
    "Dialects",
    "ErrorShape",
    "EventStreamResponse",
    "Fit",
    "GracefulServer",
    "HostMiddleware",
    "JsonBodyMiddleware",
    "NotHere",
    "RefusalMiddleware",
    "RequestIdMiddleware",
    "RequestPath",
    "ServerSettings",
    "ServerState",
    "Serving",
    "StreamEnd",
    "Submitted",
    "TokenbeltOptions",
    "ToolPlan",
    "UnsupportedParameter",
    "admin_asked",
    "answer_embedding",
    "answer_transcription",
    "check_dimensions",
    "compact_json",
    "control_router",
    "encode_vector",
    "error_body",
    "error_response",
    "failure",
    "file_text",
    "http_protocol",
    "in_pieces",
    "install",
    "named_sse",
    "ndjson",
    "openai_shape",
    "plan_tools",
    "prompt_progress",
    "public",
    "ranges",
    "response_for",
    "scrub",
    "shrink",
    "speech_model_for",
    "sse",
    "stream_transcription",
    "submit_embedding",
    "submit_transcription",
    "think_said_as",
    "tokenbelt_final",
    "until_end",
    "with_progress",
]
