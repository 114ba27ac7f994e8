"""What a model costs in memory, before it is loaded and once it is, and the one budget
all loaded models share.

Before a load, the cost is estimated from the GGUF file's own metadata: its weights
(the file's size: llama.cpp maps it and, on a CPU, touches every page), its KV cache
(``slots * n_ctx`` cells for the sequences; each cell is ``layers * kv_heads * (key +
value length)`` elements of the cache's type), its prefix cache (``cache_tokens`` cells'
worth, the entries held in the process's memory) and a fixed overhead (the worker
process, llama.cpp's compute buffers). Once loaded, a model in a worker process is
measured too (its worker's resident set), and counted at the larger of the two: a new
worker's KV pages are not resident until sequences fill them, and a worker that grew
past its estimate counts what it holds.

The budget (``MemoryBudget``) decides what a new load may unload: only models that
are loaded, not pinned, and idle (nothing running, queued or being submitted), the
least recently used first, then the shortest keep-alive. A model that could never fit
(its estimate alone is more than the budget) is refused at once; one that does not
fit now because pinned or busy models hold the rest is refused with their names.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._errors import InvalidArgument, ModelError, ModelLoadError, OverBudget
from ..engines import LlamaConfig, cache_tokens_for, context_that_fits
from ..models import read_header

logger = logging.getLogger("tokenbelt.runtime")

#: what a loaded model holds beyond its weights and KV cache: the worker process
#: (an interpreter with llama-cpp-python imported) and llama.cpp's compute buffers.
#: Measured with the default model (``benchmarks/models.py``: a worker's resident set
#: with every slot's cells in use, less its weights and KV cache): 124 MiB.
OVERHEAD_BYTES = 128 << 20
#: the share of this machine's available memory the default budget takes
DEFAULT_SHARE = 0.8


def default_budget() -> int:
    """``DEFAULT_SHARE`` of the memory available now (RAM not in use, as the OS counts it)."""
    import psutil

    return int(psutil.virtual_memory().available * DEFAULT_SHARE)


@dataclass(frozen=True)
class MemoryUse:
    """What one model takes, in bytes; ``measured`` once loaded in a worker (its RSS)."""

    weights: int
    kv: int
    cache: int
    overhead: int = OVERHEAD_BYTES
    #: the worker's resident set, when the model is loaded in one (else None)
    measured: int | None = None

    @property
    def estimated(self) -> int:
        return self.weights + self.kv + self.cache + self.overhead

    @property
    def total(self) -> int:
        """What the budget counts: the estimate, or the measured size once it is more.
        A freshly loaded model's resident set is less than it will be (the KV cache's
        pages are touched only as sequences fill them), so the estimate stays the floor."""
        return max(self.estimated, self.measured or 0)

    def parts(self) -> dict[str, int]:
        """The estimate's parts, as ``MemoryUse(**parts)`` takes them back."""
        return {
            "weights": self.weights,
            "kv": self.kv,
            "cache": self.cache,
            "overhead": self.overhead,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights_bytes": self.weights,
            "kv_bytes": self.kv,
            "cache_bytes": self.cache,
            "overhead_bytes": self.overhead,
            "estimated_bytes": self.estimated,
            "measured_bytes": self.measured,
            "total_bytes": self.total,
        }


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file, from its header alone (milliseconds:
    arrays such as the vocabulary are stepped over). ``ModelLoadError`` for a file that
    cannot be read as GGUF."""
    try:
        return read_header(Path(path)).metadata
    except ModelError as exc:
        raise ModelLoadError(str(exc)) from exc


def kv_cell_bytes(path: str | Path, kv_type: str = "f16") -> float:
    """Bytes one token takes in ``path``'s KV cache, from its metadata; ``ModelLoadError``
    for a file that cannot be read as GGUF."""
    try:
        return read_header(Path(path)).kv_cell_bytes(kv_type)
    except ModelError as exc:
        raise ModelLoadError(str(exc)) from exc


def sized(
    config: LlamaConfig, path: str | Path, *, given: bool, trained: int | None
) -> LlamaConfig:
    """``config`` with what depends on the model file's KV cell size: a context not given
    lowered until the KV cache fits (``context_that_fits``), and a prefix cache not given
    sized by memory (``cache_tokens_for``)."""
    cell = kv_cell_bytes(path, config.kv_type)
    n_ctx = (
        config.n_ctx if given else min(config.n_ctx, context_that_fits(trained, config.slots, cell))
    )
    return LlamaConfig.of(
        config, n_ctx=n_ctx, cache_tokens=cache_tokens_for(config.cache_tokens, cell)
    )


def estimate(
    path: str | Path, *, slots: int, n_ctx: int, cache_tokens: int | None, kv_type: str = "f16"
) -> MemoryUse:
    """What loading ``path`` with these settings will take, from its metadata
    (``cache_tokens`` None: the prefix cache sized by memory, ``cache_tokens_for``)."""
    cell = kv_cell_bytes(path, kv_type)
    return MemoryUse(
        weights=Path(path).stat().st_size,
        kv=int(cell * slots * n_ctx),
        cache=int(cell * cache_tokens_for(cache_tokens, cell)),
    )


class Evictable(Protocol):
    """What the budget needs of a model (``runtime.Model`` is one)."""

    name: str
    pinned: bool
    last_used: float

    @property
    def keep_alive(self) -> float | None: ...

    def memory(self) -> MemoryUse | None: ...  # None: not loaded

    def busy(self) -> bool: ...

    def evict(self, why: str) -> bool: ...  # False: it became busy meanwhile


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


class MemoryBudget:
    """One budget for every model a runtime loads; ``make_room`` runs before each load.

    Loads are made one at a time under ``lock`` (``Runtime`` holds it around the room
    and the load), so two loads never both count the same free memory.
    """

    def __init__(self, limit: int | None) -> None:
        if limit is not None and (isinstance(limit, bool) or limit <= 0):
            raise InvalidArgument(f"memory_budget must be > 0 bytes (None: no budget), got {limit}")
        #: bytes all loaded models may take together (None: no limit)
        self.limit = limit
        self.lock = threading.RLock()
        #: (the model evicted, for which model) of every eviction, in order
        self.evictions: list[tuple[str, str]] = []

    def make_room(
        self,
        name: str,
        need: MemoryUse,
        models: Iterable[Evictable],
        on_evict: Callable[[str, str], None] | None = None,
    ) -> None:
        """Unload idle models until ``need`` fits beside the rest, or raise ``OverBudget``
        (``transient`` when busy models hold what is missing) without unloading any."""
        limit = self.limit
        if limit is None:
            return
        if need.estimated > limit:
            raise OverBudget(
                f"model {name} needs about {_mib(need.estimated)} (weights "
                f"{_mib(need.weights)}, KV cache {_mib(need.kv)}, prefix cache "
                f"{_mib(need.cache)}, worker {_mib(need.overhead)}) and the memory budget is "
                f"{_mib(limit)}: it can never be loaded here (give a larger --memory-budget, "
                "fewer slots or a smaller context)",
                transient=False,
            )
        others = [m for m in models if m.name != name]
        loaded = [(m, use) for m in others if (use := m.memory()) is not None]
        used = sum(use.total for _, use in loaded)
        if used + need.estimated <= limit:
            return
        idle = [(m, use) for m, use in loaded if not m.pinned and not m.busy()]
        idle.sort(key=lambda pair: (pair[0].last_used, pair[0].keep_alive or float("inf")))
        freeable = sum(use.total for _, use in idle)
        if used - freeable + need.estimated > limit:
            held = [m for m, _ in loaded if m.pinned or m.busy()]
            what = ", ".join(f"{m.name} ({'pinned' if m.pinned else 'busy'})" for m in held)
            pinned = all(m.pinned for m in held)
            raise OverBudget(
                f"model {name} needs about {_mib(need.estimated)} and the memory budget is "
                f"{_mib(limit)}: {_mib(used - freeable)} of it is held by {what}, which "
                + ("stay loaded" if pinned else "cannot be unloaded while they work: try again"),
                transient=not pinned,
            )
        for model, use in idle:
            if used + need.estimated <= limit:
                break
            if model.evict(f"evicted to make room for {name} (memory budget {_mib(limit)})"):
                used -= use.total
                self.evictions.append((model.name, name))
                if on_evict is not None:
                    on_evict(model.name, name)
                logger.info("evicted %s (%s) to load %s", model.name, _mib(use.total), name)
        if used + need.estimated > limit:  # one turned busy between the count and its unload
            raise OverBudget(
                f"model {name} needs about {_mib(need.estimated)}: the models loaded took "
                f"requests while it was being made room for; try again",
                transient=True,
            )
