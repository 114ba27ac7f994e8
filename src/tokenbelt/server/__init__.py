"""Layer 5: the OpenAI-compatible HTTP service and the web page it serves."""

from ._app import create_app
from .core._h11 import http_protocol
from .core._state import ServerSettings

__all__ = ["ServerSettings", "create_app", "http_protocol"]
