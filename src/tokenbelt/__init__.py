"""tokenbelt: a local LLM runtime where every token stream is bounded, stoppable,
timed and explained.

The package is layered; lower layers never import higher ones:

1. ``tokenbelt.belt``: the bounded channel, cancellation, deadlines, trace
2. ``tokenbelt.engines``: llama.cpp, remote (OpenAI-compatible upstreams), scripted
3. ``tokenbelt.models``: catalog, resolution, download cache, probe
4. ``tokenbelt.runtime``: loaded models, slots, admission queue, sessions (the SDK)
5. surfaces: ``tokenbelt.server`` (HTTP), ``tokenbelt.cli``
"""

from ._errors import (
    AdmissionError,
    Cancelled,
    CatalogError,
    DecodeError,
    DownloadCancelled,
    DownloadError,
    EndOfStream,
    EngineError,
    IllegalState,
    IntegrityError,
    InvalidArgument,
    LoadTimeout,
    ModelError,
    ModelLoadError,
    ModelLoading,
    PromptTooLong,
    QueueFull,
    RuntimeClosed,
    TokenbeltError,
    UnknownModel,
    UpstreamError,
    UpstreamUnavailable,
    WorkerCrashed,
)
from .belt import Belt, BeltStatistics, EndReason, Limits, Trace, TraceEvent
from .engines import (
    GenerationRequest,
    LlamaEngine,
    RemoteEngine,
    SamplingParams,
    ScriptedEngine,
    TokenLogprob,
    Upstream,
)
from .runtime import (
    DEFAULT_ALIAS,
    ChatSession,
    Model,
    ModelState,
    Reply,
    Runtime,
    SchedulerStatistics,
    Stream,
    Tool,
    ToolCall,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ALIAS",
    "AdmissionError",
    "Belt",
    "BeltStatistics",
    "Cancelled",
    "CatalogError",
    "ChatSession",
    "DecodeError",
    "DownloadCancelled",
    "DownloadError",
    "EndOfStream",
    "EndReason",
    "EngineError",
    "GenerationRequest",
    "IllegalState",
    "IntegrityError",
    "InvalidArgument",
    "Limits",
    "LlamaEngine",
    "LoadTimeout",
    "Model",
    "ModelError",
    "ModelLoadError",
    "ModelLoading",
    "ModelState",
    "PromptTooLong",
    "QueueFull",
    "RemoteEngine",
    "Reply",
    "Runtime",
    "RuntimeClosed",
    "SamplingParams",
    "SchedulerStatistics",
    "ScriptedEngine",
    "Stream",
    "TokenLogprob",
    "TokenbeltError",
    "Tool",
    "ToolCall",
    "Trace",
    "TraceEvent",
    "UnknownModel",
    "Upstream",
    "UpstreamError",
    "UpstreamUnavailable",
    "Usage",
    "WorkerCrashed",
    "__version__",
]
