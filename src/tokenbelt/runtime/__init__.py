"""Layer 4: loaded models, slots, the admission queue and chat sessions (the SDK)."""

from ..engines import sampling_from
from ..models import DEFAULT_ALIAS
from . import _structured as structured
from ._calls import Tool, ToolCall
from ._completions import STALE_ENDS, CompletionStatistics
from ._embed import Embeddings, EmbeddingStream, Ranked, Ranking
from ._memory import DEFAULT_SHARE, MemoryBudget, MemoryUse, default_budget, estimate
from ._model import Model
from ._runtime import Runtime, check_n_ctx, context_for
from ._scheduler import Scheduler, SchedulerStatistics
from ._session import ChatSession
from ._status import ModelState, ModelStatus
from ._stream import Reply, Stream, Usage
from ._supersede import Claim, Superseding
from ._transcribe import (
    DEFAULT_MAX_AUDIO_SECONDS,
    Transcription,
    TranscriptionStream,
    audio_bytes,
    check_options,
)

__all__ = [
    "DEFAULT_ALIAS",
    "DEFAULT_MAX_AUDIO_SECONDS",
    "DEFAULT_SHARE",
    "STALE_ENDS",
    "ChatSession",
    "Claim",
    "CompletionStatistics",
    "EmbeddingStream",
    "Embeddings",
    "MemoryBudget",
    "MemoryUse",
    "Model",
    "ModelState",
    "ModelStatus",
    "Ranked",
    "Ranking",
    "Reply",
    "Runtime",
    "Scheduler",
    "SchedulerStatistics",
    "Stream",
    "Superseding",
    "Tool",
    "ToolCall",
    "Transcription",
    "TranscriptionStream",
    "Usage",
    "audio_bytes",
    "check_n_ctx",
    "check_options",
    "context_for",
    "default_budget",
    "estimate",
    "sampling_from",
    "structured",
]
