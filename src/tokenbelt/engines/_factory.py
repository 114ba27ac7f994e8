"""The one door from a configuration to a running engine: ``build``.

The runtime names no engine class: it asks ``build(path, config, isolation=...)`` for
the engine that runs ``path`` with ``config``, here or in a worker process. A new
engine (a GPU engine, a speech engine) gets its configuration type and a branch here.
"""

from __future__ import annotations

from pathlib import Path

from ._base import Engine
from .llama import BatchEngine, LlamaConfig
from .speech import SpeechConfig, SpeechEngine
from .worker import DEFAULT_STOP_GRACE, WorkerEngine

#: where a loaded model runs: in this process, or in a worker process of its own
ISOLATIONS = ("thread", "process")


def build(
    path: Path,
    config: LlamaConfig | SpeechConfig,
    *,
    isolation: str = "thread",
    load_timeout: float | None = None,
    stop_grace: float = DEFAULT_STOP_GRACE,
) -> Engine:
    """Load ``path`` with ``config``: a ``BatchEngine`` in this process (``"thread"``), or
    one in a worker process (``"process"``: a ``WorkerEngine``, whose stops are bounded
    by ``stop_grace`` seconds). Blocks while loading, at most ``load_timeout`` seconds
    (``LoadTimeout``); raises ``ModelLoadError`` or ``InvalidArgument``. A speech model
    (``SpeechConfig``) always runs in a worker process of its own (``SpeechEngine``)."""
    if isinstance(config, SpeechConfig):
        return SpeechEngine.load(path, config, load_timeout=load_timeout)
    if isolation == "process":
        return WorkerEngine.load(path, config, load_timeout=load_timeout, stop_grace=stop_grace)
    return BatchEngine.load(path, config, load_timeout=load_timeout)
