"""Layer 5: the OpenAI-compatible HTTP service and the web page it serves."""

from ._app import create_app
from ._protocol import http_protocol
from ._state import ServerSettings

__all__ = ["ServerSettings", "create_app", "http_protocol"]
