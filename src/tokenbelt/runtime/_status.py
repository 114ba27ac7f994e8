"""Where a model is in its life (``ModelState``), and a snapshot of its place in the
runtime: loaded or not and why, what it holds in memory, its slots and requests, its pin
and keep-alive, its code completions (``Model.status()``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ._completions import CompletionStatistics
from ._memory import MemoryUse


class ModelState(enum.Enum):
    """Where a model is in its life."""

    #: the engines are being created (weights loading)
    LOADING = "loading"
    #: serving requests
    READY = "ready"
    #: not loaded: not yet (registered to load on its first request), or unloaded after
    #: its keep-alive or to make room for another model (``unloaded_because`` says
    #: which); the next request loads it
    IDLE_UNLOADED = "idle_unloaded"
    #: closed for good: every request was released and the memory returned
    CLOSED = "closed"

    def allows(self, new: ModelState) -> bool:
        """Whether a model may go from this state to ``new``."""
        return new in _TRANSITIONS[self]


_TRANSITIONS = {
    ModelState.LOADING: {ModelState.READY, ModelState.CLOSED},
    ModelState.READY: {ModelState.IDLE_UNLOADED, ModelState.CLOSED},
    ModelState.IDLE_UNLOADED: {ModelState.LOADING, ModelState.CLOSED},
    ModelState.CLOSED: set(),
}


@dataclass(frozen=True)
class ModelStatus:
    """What ``tokenbelt ps``, ``/health`` and Ollama's ``/api/ps`` show of a model."""

    name: str
    #: ``ModelState``'s value: loading, ready, idle_unloaded, closed
    state: str
    #: why it is not loaded (None while it is)
    unloaded_because: str | None
    pinned: bool
    #: what it takes while loaded (None: not loaded, or nothing known)
    memory: MemoryUse | None
    slots: int
    running: int
    queued: int
    #: seconds it stays loaded once idle (None: for ever)
    keep_alive: float | None
    #: seconds until its keep-alive unloads it, if it is loaded and idle now (else None)
    expires_in_s: float | None
    loads: int
    evictions: int
    #: its code completions: superseded, stale tokens, keystroke to first token
    completions: CompletionStatistics

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "unloaded_because": self.unloaded_because,
            "pinned": self.pinned,
            "memory": None if self.memory is None else self.memory.to_dict(),
            "slots": self.slots,
            "running": self.running,
            "queued": self.queued,
            "keep_alive_s": self.keep_alive,
            "expires_in_s": None if self.expires_in_s is None else round(self.expires_in_s, 1),
            "loads": self.loads,
            "evictions": self.evictions,
            "completions": self.completions.to_dict(),
        }
