"""Layer 2: the things that produce tokens (llama.cpp batched and single, a scripted engine)."""

from ._base import Engine, GenerationRequest, Message, SamplingParams
from ._batch import BatchEngine, BatchStatistics
from ._llama import LlamaEngine
from ._loading import check_gguf_file, load_with_deadline
from ._scripted import ScriptedEngine

__all__ = [
    "BatchEngine",
    "BatchStatistics",
    "Engine",
    "GenerationRequest",
    "LlamaEngine",
    "Message",
    "SamplingParams",
    "ScriptedEngine",
    "check_gguf_file",
    "load_with_deadline",
]
