"""Layer 2: the things that produce tokens (llama.cpp batched and single, in a worker
process, remote, scripted)."""

from ._base import Engine, GenerationRequest, Message, Piece, SamplingParams, TokenLogprob
from ._batch import BatchEngine, BatchStatistics
from ._discover import UpstreamModel, list_models
from ._llama import LlamaEngine
from ._loading import check_gguf_file, load_with_deadline
from ._remote import RemoteEngine
from ._scripted import ScriptedEngine
from ._upstreams import Upstream, UpstreamPool, UpstreamStatistics
from ._worker import WorkerEngine, WorkerState, WorkerStatistics

__all__ = [
    "BatchEngine",
    "BatchStatistics",
    "Engine",
    "GenerationRequest",
    "LlamaEngine",
    "Message",
    "Piece",
    "RemoteEngine",
    "SamplingParams",
    "ScriptedEngine",
    "TokenLogprob",
    "Upstream",
    "UpstreamModel",
    "UpstreamPool",
    "UpstreamStatistics",
    "WorkerEngine",
    "WorkerState",
    "WorkerStatistics",
    "check_gguf_file",
    "list_models",
    "load_with_deadline",
]
