"""The Anthropic dialect: the Messages API, ``POST /v1/messages``."""

from ._routes import PREFIX, router
from ._schemas import error_shape

__all__ = ["PREFIX", "error_shape", "router"]
