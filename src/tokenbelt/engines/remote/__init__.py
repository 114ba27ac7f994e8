"""The remote engine: another serving stack (vLLM, llama.cpp's server, Ollama, another
tokenbelt) over HTTP, with its upstream pool, the OpenAI wire format it speaks, and the
discovery of an upstream's models."""

from ._discover import UpstreamModel, list_models
from ._engine import RemoteEngine
from ._upstreams import Upstream, UpstreamPool
from ._wire import error_message, request_body

__all__ = [
    "RemoteEngine",
    "Upstream",
    "UpstreamModel",
    "UpstreamPool",
    "error_message",
    "list_models",
    "request_body",
]
