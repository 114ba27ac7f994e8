"""Layer 5: the OpenAI-compatible HTTP service and the web page it serves.

``core`` is what every API shares; ``openai``, ``ollama`` and ``anthropic`` are the
dialects over it, each in its own folder; ``_app`` assembles them.
"""

from ._app import create_app
from .core import GracefulServer, ServerSettings, http_protocol

__all__ = ["GracefulServer", "ServerSettings", "create_app", "http_protocol"]
