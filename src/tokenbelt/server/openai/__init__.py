"""The OpenAI dialect: models, chat completions and completions under ``/v1``."""

from ._reasons import finish_reason
from ._routes import router

__all__ = ["finish_reason", "router"]
