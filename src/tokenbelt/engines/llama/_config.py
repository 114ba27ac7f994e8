"""``LlamaConfig``: every setting of a llama.cpp engine, in one frozen record.

The command line, ``Runtime``, the catalog and the worker's ``Load`` message share it:
``tokenbelt serve``'s flags make one, ``Runtime(engine=...)`` holds one (and fills in each
model's slots, context and name at its load), and a worker receives it whole across the
pipe. It is checked once, when it is made; nothing downstream checks a field again.

Adding a setting: a field here (with its check in ``__post_init__`` and a line in the
docstring; a count's range is a row of ``belt/_ranges.py``, which the SDK's check, the
CLI's argparse type and the HTTP schemas share), the engine part that reads it (every
part is given the whole configuration or its own fields from it), and its flag in
``cli/_serve_options.py`` (``dest`` the field's name: ``cli/_serve.py`` passes it on).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._defaults import (
    CONTEXT_STEP,
    DEFAULT_CACHE_ENTRIES,
    DEFAULT_CACHE_MEMORY,
    DEFAULT_CACHE_REUSE,
    DEFAULT_DECODE_NICE,
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_KV_MEMORY,
    DEFAULT_N_CTX,
    DEFAULT_PREFILL_GAP,
    MIN_CACHE_TOKENS,
)
from ..._errors import InvalidArgument
from ...belt import MAX_CONTEXT, check, check_capacity, check_duration
from .._request import check_draft
from ._embed import check_pooling
from ._persist import DEFAULT_PREFIX_CACHE_DISK, check_disk_budget
from ._threads import check_decode_nice, check_threads

#: the KV cache's element types: name -> ggml type (f16: llama.cpp's default; q8_0:
#: about half its memory, with flash attention)
KV_TYPES = {"f16": 1, "q8_0": 8}
#: flash attention: name -> ``llama_flash_attn_type`` ("auto": where the device has it)
FLASH_ATTN = {"auto": -1, "on": 1, "off": 0}
#: seconds a step may run on after a stop landed in it before the stop watch aborts it
STOP_ABORT_AFTER_S = 0.03


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """How a llama.cpp engine loads and runs a model (``BatchEngine``, ``WorkerEngine``).

    - ``slots``: sequences decoded together (llama.cpp's sequence limit);
      ``n_ctx``: tokens each sequence holds (prompt, reply and a draft); past the
      model's trained context only with ``force_n_ctx``.
    - ``n_threads``/``n_threads_batch``: decode and prompt threads (None: chosen and
      tuned for this machine); ``decode_nice`` (0 to 19, Linux only): how much nicer
      than the rest of the process the decode threads run.
    - ``n_gpu_layers``: layers offloaded to a GPU; ``n_batch``: the most tokens in one
      step (one ubatch, so an abort drops it whole).
    - ``prefill_chunk``/``prefill_gap``: a prompt's tokens in a step beside decoding
      streams: what the measured prompt rate fits in ``prefill_gap`` seconds, at least
      ``prefill_chunk`` (``_plan.py``).
    - ``cache_entries``/``cache_tokens``: the prefix cache's limits (0 entries: off;
      ``cache_tokens`` None: as many as ``DEFAULT_CACHE_MEMORY`` bytes of this model's
      KV cells hold, ``cache_tokens_for``);
      ``prefix_cache_dir``/``prefix_cache_disk``: where, and in how many bytes, it
      outlives the engine (``_persist.py``); ``cache_reuse``: the shortest chunk of an
      entry kept past a changed part of a new prompt, its cells moved to where the
      prompt has it, as llama.cpp's ``--cache-reuse``, for code completions only (0: off;
      ``_reuse.py``).
    - ``kv_type`` (``KV_TYPES``) and ``flash_attn`` (``FLASH_ATTN``): the KV cache's
      element type and llama.cpp's flash attention (a q8_0 cache needs it on; with it
      greedy text is the same alone, batched, drafted or from a cached prefix; cells
      moved by ``cache_reuse`` were computed after other text).
    - ``stop_abort_after``: seconds a step runs on after a stop landed in it before the
      stop watch aborts it (``_inflight.py``).
    - ``reasoning``: split a thinking model's reply into reasoning and answer (False:
      one text, markers and all); ``pooling``: an embedding model's pooling (None: the
      file's own).
    - ``draft`` (``DRAFT_MODES``) and ``draft_tokens``: prompt-lookup drafting for
      requests that do not choose (``lookup``: where the measured row costs and each
      request's acceptance say it pays, ``_draft.py``), and the longest draft verified
      in a step.
    - ``name``: the model's name in logs, traces and thread names (None: the file's).

    Raises ``InvalidArgument`` naming the first field out of its range.
    """

    slots: int = 4
    n_ctx: int = DEFAULT_N_CTX
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_gpu_layers: int = 0
    n_batch: int = 512
    prefill_chunk: int = 128
    prefill_gap: float = DEFAULT_PREFILL_GAP
    cache_entries: int = DEFAULT_CACHE_ENTRIES
    cache_tokens: int | None = None
    cache_reuse: int = DEFAULT_CACHE_REUSE
    force_n_ctx: bool = False
    kv_type: str = "f16"
    flash_attn: str = "auto"
    stop_abort_after: float = STOP_ABORT_AFTER_S
    reasoning: bool = True
    pooling: str | None = None
    prefix_cache_dir: Path | None = None
    prefix_cache_disk: int = DEFAULT_PREFIX_CACHE_DISK
    draft: str = "lookup"
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    decode_nice: int = DEFAULT_DECODE_NICE
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_capacity(self.slots, name="slots")
        if self.n_ctx < 1:
            raise InvalidArgument(f"n_ctx must be at least 1, got {self.n_ctx}")
        check_threads("n_threads", self.n_threads)
        check_threads("n_threads_batch", self.n_threads_batch)
        check_capacity(self.n_batch, name="n_batch")
        check_capacity(self.prefill_chunk, name="prefill_chunk")
        gap = check_duration("prefill_gap", self.prefill_gap)
        object.__setattr__(self, "prefill_gap", float(gap or 0.0))
        if self.cache_entries < 0:
            raise InvalidArgument(f"cache_entries must be 0 or more, got {self.cache_entries}")
        if self.cache_tokens is not None:
            check("cache_tokens", self.cache_tokens)
        check("cache_reuse", self.cache_reuse)
        if self.kv_type not in KV_TYPES:
            raise InvalidArgument(
                f"kv_type must be one of {', '.join(KV_TYPES)}, got {self.kv_type!r}",
                param="kv_type",
            )
        if self.flash_attn not in FLASH_ATTN:
            raise InvalidArgument(
                f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {self.flash_attn!r}",
                param="flash_attn",
            )
        if self.flash_attn == "off" and self.kv_type != "f16":
            raise InvalidArgument(
                f"a {self.kv_type} KV cache needs flash attention: flash_attn "
                "(--flash-attn) 'auto' or 'on', not 'off'",
                param="flash_attn",
            )
        after = check_duration("stop_abort_after", self.stop_abort_after, allow_zero=True)
        object.__setattr__(self, "stop_abort_after", STOP_ABORT_AFTER_S if after is None else after)
        check_pooling(self.pooling)
        if self.prefix_cache_dir is not None:
            object.__setattr__(self, "prefix_cache_dir", Path(self.prefix_cache_dir))
        check_disk_budget(self.prefix_cache_disk)
        check_draft(self.draft)
        check("draft_tokens", self.draft_tokens)
        check_decode_nice(self.decode_nice)

    @classmethod
    def of(cls, base: LlamaConfig | None = None, **options: Any) -> LlamaConfig:
        """``base`` (default: every default) with ``options`` set; an unknown option is
        an ``InvalidArgument`` naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown engine option {', '.join(unknown)} (known: {', '.join(sorted(known))})",
                param=unknown[0],
            )
        return dataclasses.replace(base, **options) if base is not None else cls(**options)

    @property
    def prefix_cache(self) -> bool:
        """Whether the prefix cache is on."""
        return self.cache_entries > 0


def cache_tokens_for(given: int | None, cell_bytes: float) -> int:
    """The tokens a prefix cache keeps: ``given``, else as many as ``DEFAULT_CACHE_MEMORY``
    bytes of KV cells of ``cell_bytes`` each hold (at least ``MIN_CACHE_TOKENS``)."""
    if given is not None:
        return given
    if cell_bytes <= 0:  # a file that does not say its shape: its load says what is wrong
        return MIN_CACHE_TOKENS
    return min(MAX_CONTEXT, max(MIN_CACHE_TOKENS, int(DEFAULT_CACHE_MEMORY // cell_bytes)))


def context_that_fits(trained: int | None, slots: int, cell_bytes: float) -> int:
    """The context a model gets when none is given: what it was trained on (else
    ``DEFAULT_N_CTX``), lowered to a multiple of ``CONTEXT_STEP`` until ``slots``
    sequences of it fit ``DEFAULT_KV_MEMORY``; never below ``DEFAULT_N_CTX`` (or the
    trained length, if less)."""
    context = trained or DEFAULT_N_CTX
    fits = int(DEFAULT_KV_MEMORY // max(slots * cell_bytes, 1.0))
    if fits < context:
        context = max(min(DEFAULT_N_CTX, context), fits // CONTEXT_STEP * CONTEXT_STEP)
    return context
