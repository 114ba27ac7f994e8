"""The Ollama dialect: ``/api/chat``, ``/api/generate`` and the model routes under ``/api/``."""

from ._routes import PREFIX, router
from ._schemas import error_shape

__all__ = ["PREFIX", "error_shape", "router"]
