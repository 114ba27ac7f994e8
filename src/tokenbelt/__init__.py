"""tokenbelt: a local LLM runtime where every token stream is bounded, stoppable,
timed and explained.

The package is layered; lower layers never import higher ones:

1. ``tokenbelt.belt``: the bounded channel, cancellation, deadlines, trace
2. ``tokenbelt.engines``: what produces tokens, behind one producer contract:

    - the batch engine, ``BatchEngine`` (package ``tokenbelt.engines.llama``): llama.cpp
      serving many sequences from one context, set up by one ``LlamaConfig``; its decode
      loop is ``BatchEngine._step_once`` and ``Running.step`` (admit, retire, plan,
      decode, sample);
    - the worker engine, ``WorkerEngine``: the batch engine in a process of its own, so
      a native crash costs a restart, not the server; its pipe protocol is
      ``tokenbelt/engines/worker/_messages.py``;
    - ``RemoteEngine``: OpenAI-compatible upstreams; ``ScriptedEngine``: the test double
3. ``tokenbelt.models``: catalog, resolution, download cache, probe
4. ``tokenbelt.runtime``: loaded models, slots, admission queue, sessions (the SDK)
5. surfaces: ``tokenbelt.server`` (HTTP), ``tokenbelt.cli``

What is exported here is the SDK's surface; every public name says it lives in
``tokenbelt`` (``__module__``), as trio's do. Engine authors import ``Producer`` and
``Belt`` from ``tokenbelt.belt``; the single-sequence ``LlamaEngine``, which the runtime
no longer builds, stays importable from ``tokenbelt.engines`` as a benchmark baseline.
"""

import inspect as _inspect
import typing as _typing

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
    OverBudget,
    PromptTooLong,
    QueueFull,
    RuntimeClosed,
    TokenbeltError,
    UnknownModel,
    UpstreamError,
    UpstreamUnavailable,
    WorkerCrashed,
)
from .belt import BeltStatistics, EndReason, Limits, Trace, TraceEvent
from .engines import (
    BatchEngine,
    GenerationRequest,
    LlamaConfig,
    RemoteEngine,
    SamplingParams,
    ScriptedEngine,
    Segment,
    TokenLogprob,
    Upstream,
    WorkerEngine,
)
from .runtime import (
    DEFAULT_ALIAS,
    ChatSession,
    Embeddings,
    EmbeddingStream,
    Model,
    ModelState,
    Ranked,
    Ranking,
    Reply,
    Runtime,
    SchedulerStatistics,
    Stream,
    Tool,
    ToolCall,
    Transcription,
    TranscriptionStream,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ALIAS",
    "AdmissionError",
    "BatchEngine",
    "BeltStatistics",
    "Cancelled",
    "CatalogError",
    "ChatSession",
    "DecodeError",
    "DownloadCancelled",
    "DownloadError",
    "EmbeddingStream",
    "Embeddings",
    "EndOfStream",
    "EndReason",
    "EngineError",
    "GenerationRequest",
    "IllegalState",
    "IntegrityError",
    "InvalidArgument",
    "Limits",
    "LlamaConfig",
    "LoadTimeout",
    "Model",
    "ModelError",
    "ModelLoadError",
    "ModelLoading",
    "ModelState",
    "OverBudget",
    "PromptTooLong",
    "QueueFull",
    "Ranked",
    "Ranking",
    "RemoteEngine",
    "Reply",
    "Runtime",
    "RuntimeClosed",
    "SamplingParams",
    "SchedulerStatistics",
    "ScriptedEngine",
    "Segment",
    "Stream",
    "TokenLogprob",
    "TokenbeltError",
    "Tool",
    "ToolCall",
    "Trace",
    "TraceEvent",
    "Transcription",
    "TranscriptionStream",
    "UnknownModel",
    "Upstream",
    "UpstreamError",
    "UpstreamUnavailable",
    "Usage",
    "WorkerCrashed",
    "WorkerEngine",
    "__version__",
]


def _fixup_module_metadata() -> None:
    """Every public class says it lives in ``tokenbelt``, as trio's do.

    Only names that ``tokenbelt.<name>`` resolves back to, so ``pickle`` (which finds a
    class by ``__module__`` and ``__qualname__``) still finds the same object: the
    worker process unpickles ``GenerationRequest`` and its parts this way. A class's
    string annotations are resolved first, while its own module still names them:
    ``typing.get_type_hints`` (and pydantic, which uses it) reads the globals of
    ``__module__``, where ``tokenbelt``'s lack ``Message`` or ``Mapping``.
    """
    for name in __all__:
        member = globals()[name]
        module = getattr(member, "__module__", None)
        private = isinstance(module, str) and module.startswith(f"{__name__}.")
        if callable(member) and private and getattr(member, "__qualname__", None) == name:
            if isinstance(member, type):
                _resolve_annotations(member)
            member.__module__ = __name__


def _resolve_annotations(cls: type) -> None:
    own = _inspect.get_annotations(cls)
    if not own:
        return
    try:
        hints = _typing.get_type_hints(cls, include_extras=True)
    except Exception:  # a name imported for type checkers only: it never resolved
        return
    cls.__annotations__ = {key: hints[key] for key in own}


_fixup_module_metadata()
