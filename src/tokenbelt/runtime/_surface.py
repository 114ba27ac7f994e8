"""What the SDK's call surfaces stand on: the two ways ``Model`` uses its loaded engine.

``ChatCalls`` (``_session.py``) and ``EmbeddingCalls`` (``_embed.py``) are ``Model``'s
chat and embedding surfaces; ``Model`` (``_model.py``) implements ``EngineCalls``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..belt import Belt, Limits
from ..engines import Engine

_T = TypeVar("_T")


class EngineCalls:
    """``_on_engine``: use the loaded engine now, queueing nothing (loading it if it was
    unloaded for being idle); ``_queue``: queue a request through the model's admission
    queue (``prepare`` makes it on the engine, ``open_stream`` the caller's view)."""

    name: str

    def _on_engine(self, use: Callable[[Engine], _T]) -> _T:
        raise NotImplementedError

    def _queue(
        self,
        prepare: Callable[[Engine], tuple[Any, int]],
        open_stream: Callable[[Any, Belt[Any]], _T],
        limits: Limits | None,
        capacity: int | None,
        request_id: str | None,
    ) -> _T:
        raise NotImplementedError
