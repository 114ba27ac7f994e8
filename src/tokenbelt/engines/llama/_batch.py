"""The batch engine: many sequences in one llama.cpp context, one decode loop.

One engine thread runs the loop. Each step builds one ``llama_batch`` from

- one decode token for every running sequence whose belt has room: a full belt
  leaves its sequence out of the step (a slow reader pauses only its own stream
  and costs no compute) and asks to be woken when a read makes room;
- prompt chunks of admitted sequences: while any sequence is decoding, as many
  tokens as this engine's measured prompt rate fits in ``prefill_gap`` seconds (at
  least ``prefill_chunk``), so a long new prompt pauses running streams for about
  that long a step rather than for its whole prefill; up to ``n_batch`` when none
  is (the fastest first token).

Where a stop lands, per sequence:

- a cancelled sequence leaves before the next step: its KV cells are freed and its
  release is recorded then (within one batched step of the stop);
- a running ``llama_decode`` is aborted through llama.cpp's abort hook at once when
  every sequence in it is cancelled, or when it carries the cancelled sequence's own
  prompt chunk; otherwise the step may end first, but one that is still running
  ``stop_abort_after`` seconds after the stop (a long step: a busy machine whose
  threads wait for a core, a big prompt chunk beside it) is aborted then, by the
  engine's stop watch, and one that this engine's own timings of such steps say will
  run longer than that is aborted at once. llama.cpp then drops that step's cells, and
  every surviving sequence goes on from where its KV ends (``llama_memory_seq_pos_max``): a stop
  never ends, corrupts or errors another stream, and costs it at most one step redone.

Prefix cache: a sequence that ends (naturally, or stopped: what it computed before the
stop) leaves its cells' contents as a cache entry (up to ``cache_entries`` entries and
``cache_tokens`` tokens, least recently used evicted first; a sequence longer than
``cache_tokens`` leaves its first ``cache_tokens``: a long agent prompt's instructions
and tools are its shared part); one that failed does not.
The load's warm-up step leaves one more: the chat template's head. Entries are held in
this process's memory (``llama_state_seq_get_data``), not as cells of the KV cache:
every row of a step looks at every cell up to the highest one in use, so cells kept
for later slowed every stream (a lone stream of the default model: 156 tok/s with the
cache empty, 112 after a few batches had filled it). A new request whose prompt shares
a prefix with an entry gets those cells back (``llama_state_seq_set_data``, a copy:
2-6 ms for 1,500 tokens of the default model) and evaluates only the rest; one that
shares a prefix with a running sequence copies its cells (``llama_memory_seq_cp``);
``trace.cached_tokens`` says how many it reused.
``cache_entries=0`` turns the cache off: every prompt is then computed in full, so
identical prompts give identical greedy text whatever ran before or beside them.
With a ``prefix_cache_dir`` the entries outlive the engine: ``close()`` writes them
there (within ``prefix_cache_disk`` bytes) and the next load of the same model with
the same KV settings reads them back before it takes a request (``_persist.py``).

The KV cache is one unified buffer of ``slots * n_ctx`` cells: each sequence may
hold up to ``n_ctx`` tokens (prompt, reply and a draft), and shared prefixes take
their cells once. Prefix-cache entries are not cells: each is a copy of its
sequence's cells in the process's memory, put back into a new sequence's cells on a
hit, so a saved set is read back one entry at a time.

Drafting (``draft="lookup"``, or a request's own ``draft``): a decoding sequence may
add a draft of up to ``draft_tokens`` tokens, taken from its own earlier text, to its
pending token in a step; the rows are sampled in order and the draft is accepted up
to the first sample that differs (``_verify``), the cells of the rest are removed at
once. It is measured per request and turns itself off where it does not pay
(``_draft.py``). A draft's cells never outlive its step: ``n_past`` counts only
verified tokens, an aborted step and a retired sequence drop the rest. Sequences with
a grammar or a reasoning phase never draft (their samplers' state and the forced
end marker are tied to one token per step); their text would not change, but the
bookkeeping would not be simple.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import ctypes
import logging
import random
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ..._defaults import DEFAULT_DECODE_NICE, DEFAULT_DRAFT_TOKENS, DEFAULT_PREFILL_GAP
from ..._errors import (
    Cancelled,
    DecodeError,
    IllegalState,
    InvalidArgument,
    ModelLoadError,
    PromptTooLong,
)
from ...belt import DeadlineTimer, EndReason, Producer, check, check_capacity, check_duration
from .._base import OnExit, check_can_start, run_to_end
from .._embedding import EmbeddingInfo, EmbeddingRequest
from .._request import GenerationRequest, Piece, SamplingParams, TokenLogprob, check_draft
from .._statistics import BatchStatistics
from ._binding import flag_abort_callback, model_params, quiet_native_logs
from ._draft import Lookup, best_length
from ._embed import (
    Embedder,
    EmbedJob,
    check_inputs,
    check_pooling,
    embedding_info,
    input_tokens,
    pair_tokens,
)
from ._grammar import GrammarSampler, check_grammar
from ._loading import check_gguf_file, load_gguf
from ._native import (
    StopMatcher,
    chat_formatter,
    held_back,
    prompt_tokens,
    template_tools,
    tool_format,
)
from ._persist import DEFAULT_PREFIX_CACHE_DISK, PrefixStore, check_disk_budget, model_key
from ._reasoning import (
    ANSWER,
    REASONING,
    PhaseSplitter,
    ReasoningFormat,
    check_reasoning,
    detect_reasoning,
    template_options,
)
from ._threads import (
    ThreadTuner,
    check_decode_nice,
    check_threads,
    default_threads,
    lower_this_thread,
    set_threads,
    system_load,
    thread_candidates,
    usable_cores,
)

logger = logging.getLogger("tokenbelt.engines.batch")

#: the KV cache's element types: name -> ggml type (f16: llama.cpp's default; q8_0:
#: about half its memory, with flash attention)
KV_TYPES = {"f16": 1, "q8_0": 8}
#: flash attention: name -> ``llama_flash_attn_type`` ("auto": where the device has it)
FLASH_ATTN = {"auto": -1, "on": 1, "off": 0}
#: at most this many other requests are named in one trace's ``batched_with``
_MAX_PEERS = 32
#: prompts tokenized by ``count_prompt_tokens`` and kept for their admission
_MAX_TOKENIZED = 256
#: seconds a step may run on after a stop landed in it before the stop watch aborts it
STOP_ABORT_AFTER_S = 0.03
#: steps with at least this many tokens time the prompt rate (smaller ones are mostly
#: fixed costs)
_PROMPT_TIMED_TOKENS = 64
#: steps of at most this many tokens are timed per size (a forced marker's step, a
#: drafted step: ``draft_tokens`` is at most 64)
_TIMED_STEP_TOKENS = 64


def check_fits(n: int, context_length: int) -> None:
    """Refuse a prompt of ``n`` tokens that is empty or leaves a sequence no room to
    generate; raises ``InvalidArgument`` or ``PromptTooLong``."""
    if n == 0:
        # An empty batch would reach llama_decode: refused, never decoded.
        raise InvalidArgument("the prompt is empty: it has no tokens to start from")
    if n + 1 > context_length:
        raise PromptTooLong(
            f"the prompt has {n} tokens but each sequence holds {context_length} "
            "(including at least one generated token)"
        )


class KeptPrompts:
    """Prompts tokenized before queueing, kept for their admission.

    Keyed by identity, holding the request so its id cannot be reused; bounded, since a
    counted request may never be started (a full queue refuses it). Thread-safe.
    """

    def __init__(self, limit: int = _MAX_TOKENIZED) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._kept: dict[int, tuple[GenerationRequest, list[int]]] = {}

    def keep(self, request: GenerationRequest, tokens: list[int]) -> None:
        with self._lock:
            self._kept[id(request)] = (request, tokens)
            while len(self._kept) > self._limit:
                del self._kept[next(iter(self._kept))]

    def take(self, request: GenerationRequest) -> list[int] | None:
        """The tokens kept for ``request`` (forgotten here), or None."""
        with self._lock:
            kept = self._kept.pop(id(request), None)
        return kept[1] if kept is not None and kept[0] is request else None

    def peek(self, request: GenerationRequest) -> list[int] | None:
        """The tokens kept for ``request`` (still kept), or None."""
        with self._lock:
            kept = self._kept.get(id(request))
        return kept[1] if kept is not None and kept[0] is request else None


def _moving(average: float | None, sample: float) -> float:
    """A step timing's moving average: the first sample, then a fifth of each new one."""
    return sample if average is None else 0.8 * average + 0.2 * sample


class _Seq:
    """One admitted request: its tokens, its place in the KV cache, its sampler."""

    __slots__ = (
        "cancelled",
        "decoder",
        "draft",
        "grammar",
        "id",
        "lookup",
        "max_new",
        "n_past",
        "n_prompt",
        "on_exit",
        "phases",
        "prepared",
        "produced",
        "producer",
        "request",
        "sampler",
        "stopper",
        "think_budget",
        "think_timer",
        "think_until",
        "tokens",
        "waiting_room",
    )

    def __init__(
        self, request: GenerationRequest, producer: Producer[str], on_exit: Callable[[], None]
    ) -> None:
        self.request = request
        self.producer = producer
        self.on_exit = on_exit
        self.id = -1
        self.tokens: list[int] = []  # prompt, then every sampled token
        self.n_past = 0  # tokens[:n_past] are in the KV cache
        self.n_prompt = 0
        self.produced = 0
        self.max_new = 0
        self.sampler: Any = None
        self.grammar: GrammarSampler | None = None
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stopper = StopMatcher(request.sampling.stop)
        self.cancelled = False
        self.waiting_room = False
        self.prepared = False  # started and tokenized (it may still wait to share a prefix)
        #: a thinking model's chat request: its output split into reasoning and answer
        self.phases: PhaseSplitter | None = None
        #: reasoning tokens allowed (None: no budget), and the phase's monotonic deadline
        self.think_budget: int | None = None
        self.think_until: float | None = None
        #: what the engine's deadline timer holds (weakly) for that deadline
        self.think_timer: _ThinkingDeadline | None = None
        #: prompt-lookup drafting (None: off for this request), and the draft in flight:
        #: its cells follow the pending token's in the KV cache until it is verified
        self.lookup: Lookup | None = None
        self.draft: list[int] = []

    @property
    def decoding(self) -> bool:
        return self.produced > 0 or len(self.tokens) > self.n_prompt


class _ThinkingDeadline:
    """A sequence's thinking deadline, as the engine's ``DeadlineTimer`` sees it: at its
    time, the step in flight is aborted if it computes this sequence alone, so the end
    marker goes into the very next step instead of the one after."""

    __slots__ = ("__weakref__", "engine", "seq")

    def __init__(self, engine: BatchEngine, seq: _Seq) -> None:
        self.engine = engine
        self.seq = seq

    def expire(self) -> float | None:
        when = self.seq.think_until
        if when is None:
            return None  # the phase ended before its deadline
        if time.monotonic() < when:
            return when
        self.engine._thinking_expired(self.seq)
        return None


class _CacheEntry:
    """A prefix-cache entry: its tokens and its cells' contents, held in this process's
    memory (``llama_state_seq_get_data``), not in the KV cache."""

    __slots__ = ("state", "tokens")

    def __init__(self, tokens: list[int], state: Any) -> None:
        self.tokens = tokens
        self.state = state


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_logit_bias(s: SamplingParams, n_vocab: int, name: str) -> None:
    """``logit_bias`` names tokens of the model's vocabulary (``InvalidArgument``)."""
    for token, _bias in s.logit_bias:
        if token >= n_vocab:
            raise InvalidArgument(
                f"logit_bias: token {token} is not in {name}'s vocabulary (ids 0 to {n_vocab - 1})",
                param="logit_bias",
            )


def check_request(
    lib: Any,
    vocab: Any,
    n_vocab: int,
    request: GenerationRequest,
    name: str,
    reasoning: ReasoningFormat | None = None,
) -> None:
    """What only the model can check, before a request queues: ``logit_bias`` names
    tokens of its vocabulary, a grammar parses against it, and ``think`` asks what the
    chat template can do (``reasoning``: its markers) (``InvalidArgument``)."""
    check_logit_bias(request.sampling, n_vocab, name)
    check_reasoning(reasoning, request, name)
    if request.grammar is not None:
        s = request.sampling
        for field in ("ignore_eos", "min_tokens"):
            if getattr(s, field):
                # A grammar that is complete allows only the end: banning it leaves nothing.
                raise InvalidArgument(
                    f"{field} cannot be combined with a grammar (response_format, tools): "
                    "a complete grammar can only end the reply",
                    param=field,
                )
        check_grammar(lib, vocab, request.grammar)


class BatchEngine:
    """One llama.cpp context serving up to ``slots`` requests at once, batched.

    ``start(request, producer, on_exit)`` never blocks: the engine thread admits the
    request at its next step. For each request the engine calls ``producer.start()``
    when it is admitted, ``finish``/``fail`` (or sees the producer's cancel), then
    ``on_exit()`` and ``producer.release()`` once its KV cells are free or cached.
    At most ``slots`` requests may be started and not yet released.

    ``prefix_cache_dir`` (None: off) keeps the prefix cache across loads: ``close()``
    writes its entries there within ``prefix_cache_disk`` bytes (all models in that
    directory together; 0: off), and the next engine on the same model file with the
    same ``kv_type`` reads them back while it loads (``_persist.py`` has the key, the
    format and the invalidation rule).

    ``flash_attn`` ("auto", as llama.cpp's server has it: on for the CPU) is llama.cpp's
    flash attention; "off" computes attention over every cell in use (``FLASH_ATTN``; a
    q8_0 cache needs it on). With an f16 cache a stream's greedy text depends on what
    shares its steps: llama.cpp's CPU kernels pick their path by the step's shape (one
    row over 512 or more cells splits attention across the decode threads; 64 rows or
    more take a tiled kernel; without flash attention one row's products differ from
    many rows'), so a row is rounded by how many rows its step has. Both paths need f16
    or f32 keys: with ``kv_type="q8_0"`` every row is computed alike, and greedy text is
    the same alone, batched, drafted or from the prefix cache.

    ``decode_nice`` (0 to 19; ``DEFAULT_DECODE_NICE``, Linux only) makes the engine thread
    and llama.cpp's threads that much nicer than the rest of the process: a thread with a
    token to deliver gets a core at once instead of waiting out a decode thread's slice.

    ``draft="lookup"`` drafts by prompt lookup (up to ``draft_tokens`` tokens a step) for
    every request that does not say otherwise (``GenerationRequest.draft``); each such
    request measures whether it pays and stops drafting when it does not.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        slots: int = 4,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_gpu_layers: int = 0,
        n_batch: int = 512,
        prefill_chunk: int = 128,
        prefill_gap: float = DEFAULT_PREFILL_GAP,
        cache_entries: int = 8,
        cache_tokens: int = 4096,
        name: str | None = None,
        force_n_ctx: bool = False,
        kv_type: str = "f16",
        flash_attn: str = "auto",
        stop_abort_after: float = STOP_ABORT_AFTER_S,
        reasoning: bool = True,
        pooling: str | None = None,
        prefix_cache_dir: str | Path | None = None,
        prefix_cache_disk: int = DEFAULT_PREFIX_CACHE_DISK,
        draft: str = "off",
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        decode_nice: int = DEFAULT_DECODE_NICE,
    ) -> None:
        import llama_cpp

        path = check_gguf_file(model_path)
        check_pooling(pooling, path)
        if kv_type not in KV_TYPES:
            raise InvalidArgument(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        if flash_attn not in FLASH_ATTN:
            raise InvalidArgument(
                f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {flash_attn!r}"
            )
        if flash_attn == "off" and kv_type != "f16":
            raise InvalidArgument(f"a {kv_type} KV cache needs flash attention (not 'off')")
        check_disk_budget(prefix_cache_disk)
        check_draft(draft)
        #: how much nicer than the rest of the process the engine thread and llama.cpp's
        #: threads run (``DEFAULT_DECODE_NICE``)
        self.decode_nice = check_decode_nice(decode_nice)
        #: the drafting of a request that asks for none of its own (``DRAFT_MODES``)
        self.draft = draft
        #: the longest draft one sequence verifies in a step
        self.draft_tokens = int(check("draft_tokens", draft_tokens))
        quiet_native_logs()
        self._lib: Any = llama_cpp
        #: the KV cache's element type (``KV_TYPES``)
        self.kv_type = kv_type
        self.model_path = path
        self.name = name or path.stem
        self.slots = check_capacity(slots, name="slots")  # llama.cpp's sequence limit
        self.context_length = n_ctx
        self.n_batch = max(n_batch, self.slots + 1)
        self.prefill_chunk = max(1, min(prefill_chunk, self.n_batch - self.slots))
        #: seconds a step's prompt tokens may take while others decode (0: exactly
        #: ``prefill_chunk`` tokens)
        self.prefill_gap = float(check_duration("prefill_gap", prefill_gap) or 0.0)
        self.cache_entries = max(0, cache_entries)
        self.cache_tokens = max(0, cache_tokens) if self.cache_entries else 0
        after = check_duration("stop_abort_after", stop_abort_after, allow_zero=True)
        self.stop_abort_after = STOP_ABORT_AFTER_S if after is None else after
        threads, threads_batch = default_threads()
        self.n_threads = check_threads("n_threads", n_threads) or threads
        self.n_threads_batch = check_threads("n_threads_batch", n_threads_batch) or threads_batch
        # Thread counts given by the caller are kept; the default adapts to the machine.
        self._tuner = (
            ThreadTuner(thread_candidates(usable_cores(), system_load()))
            if n_threads is None and n_threads_batch is None
            else None
        )
        # One sequence id a running request: cache entries hold none (they are copies in
        # memory), and the load's warm-up and restore use one while nothing runs.
        self.n_seq_max = self.slots
        self._open(path, n_ctx, n_gpu_layers, force_n_ctx, kv_type, flash_attn)
        self._read_model(reasoning)
        self._init_loop_state()
        #: where the prefix cache outlives the engine (None: it does not)
        self._store: PrefixStore | None = None
        if prefix_cache_dir is not None and prefix_cache_disk > 0 and self.cache_entries:
            try:
                key = model_key(llama_cpp, self._model.model, path, kv_type)
            except OSError as exc:
                logger.warning("%s: the prefix cache stays in memory: %s", self.name, exc)
            else:
                self._store = PrefixStore(Path(prefix_cache_dir), prefix_cache_disk, key)
        self._restored = (0, 0)  # entries, tokens
        self._saved = (0, 0)  # entries, bytes
        self._loop_failed = False
        # Embeddings: a second context on these weights, made at the first request.
        self._embedder = Embedder(
            self._model,
            embedding_info(self._model, pooling, n_ctx),
            n_threads=self.n_threads_batch,
            tuner=self._tuner,
            lock=self._cond,
            wake=self._room,
            ended=self._embed_ended,
        )
        # Thinking deadlines fire here whether or not the loop is in a step, as a
        # runtime's request deadlines do (its thread starts with the engine).
        self._deadlines = DeadlineTimer(name=f"tokenbelt-thinking-{self.name}")
        self._thread = threading.Thread(
            target=self._run, name=f"tokenbelt-batch-{self.name}", daemon=True
        )
        self._warmed = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch_stops, name=f"tokenbelt-stopwatch-{self.name}", daemon=True
        )
        self._thread.start()
        self._watcher.start()
        self._warmed.wait()

    def _open(
        self,
        path: Path,
        n_ctx: int,
        n_gpu_layers: int,
        force_n_ctx: bool,
        kv_type: str,
        flash_attn: str,
    ) -> None:
        """Load the weights (``self._model``) and make the decode context (``self._ctx``)."""
        llama_cpp = self._lib
        from llama_cpp import _internals

        try:
            mparams = model_params()
            mparams.n_gpu_layers = n_gpu_layers
            # verbose=True: not more output (llama.cpp's log lines are routed to logging
            # above), but no swapping of the process's stdout and stderr for /dev/null
            # while loading, which swallowed every other thread's output meanwhile (a
            # load abandoned at its deadline kept them swapped while the CLI printed why).
            self._model: Any = _internals.LlamaModel(
                path_model=str(path), params=mparams, verbose=True
            )
            trained = int(llama_cpp.llama_model_n_ctx_train(self._model.model))
            if n_ctx > trained and not force_n_ctx:
                self._model.close()  # type: ignore[no-untyped-call]
                raise InvalidArgument(
                    f"n_ctx {n_ctx} is more than {path.name} was trained on ({trained} "
                    "tokens): past it the model's replies degrade; give n_ctx <= "
                    f"{trained}, or force it (--force-n-ctx, force_n_ctx=True)"
                )
            cparams = llama_cpp.llama_context_default_params()
            # Cells for the running sequences only: prefix-cache entries are held in
            # memory (``_keep``), and a saved set is read back one entry at a time.
            cparams.n_ctx = self.slots * n_ctx
            cparams.n_batch = self.n_batch
            cparams.n_ubatch = self.n_batch  # one ubatch per step: an abort drops it whole
            cparams.n_seq_max = self.n_seq_max
            cparams.kv_unified = True  # shared prefixes take their cells once
            # Flash attention as llama.cpp's own server has it ("auto": on where the
            # device has it, the CPU included). Without it every step computes attention
            # over every cell up to the highest one in use, prefix-cache entries' cells
            # included; the CPU kernel skips the cells a sequence cannot see. Measured here
            # (2 threads, 400-token replies, the cache filling): 53 -> 33 tok/s off,
            # 69 -> 52 on. A q8_0 cache needs it on: llama.cpp quantizes V only inside it.
            cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
            cparams.flash_attn_type = FLASH_ATTN["on" if kv_type != "f16" else flash_attn]
            cparams.n_threads = self.n_threads
            cparams.n_threads_batch = self.n_threads_batch
            self._ctx: Any = _internals.LlamaContext(
                model=self._model, params=cparams, verbose=True
            )
            self._ctx_threads = 0  # the count the tuner last gave it (0: none yet)
        except InvalidArgument:
            raise
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load {path}: {exc}") from exc

    def _read_model(self, reasoning: bool) -> None:
        """What the loop reads of the loaded model: vocabulary, template, tool format,
        reasoning markers; the batch, and the native abort hook on the context."""
        llama_cpp = self._lib
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self._model.model))
        self._vocab = self._model.vocab
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._mem = llama_cpp.llama_get_memory(self._ctx.ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._piece = ctypes.create_string_buffer(256)
        self._formatter = chat_formatter(self._model)
        #: whether the GGUF's chat template renders tools (then requests carry ``tools``)
        self.template_tools = template_tools(self._formatter)
        self.tool_format = tool_format(self._formatter)
        #: a thinking model's reasoning markers (None: it has none, or ``reasoning=False``
        #: asked for its output as one text, markers and all)
        self.reasoning = detect_reasoning(self._model, self._formatter) if reasoning else None
        # Marker tokens rendered as their text even where the vocabulary holds them as
        # control tokens (which render as nothing), so the splitter always sees them.
        self._marker_text: dict[int, str] = {}
        if self.reasoning is not None:
            for marker in (self.reasoning.start, self.reasoning.end):
                ids = self._model.tokenize(marker.encode("utf-8"), False, True)
                if len(ids) == 1:
                    self._marker_text[int(ids[0])] = marker
        # The abort hook reads this flag natively; the loop clears it before each step.
        self._flag = ctypes.create_string_buffer(2)
        self._abort_callback = flag_abort_callback()
        llama_cpp.llama_set_abort_callback(
            self._ctx.ctx, self._abort_callback, ctypes.cast(self._flag, ctypes.c_void_p)
        )

    def _init_loop_state(self) -> None:
        """The loop's locks, queues, sequences and counters, before its thread starts."""
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # The stop watch's own condition: a notify for the loop never wakes it instead.
        self._watch = threading.Condition(self._lock)
        #: when the stop watch aborts the step in flight (a stop landed in it), or None
        self._abort_by: float | None = None
        self._escalated = 0
        #: work for the loop to run between two steps (``between_steps``)
        self._between: list[Callable[[], None]] = []
        #: wraps the sampling of each step (a worker sends a step's output as one frame)
        self._sampling: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
        self._inbox: collections.deque[_Seq] = collections.deque()
        self._active: list[_Seq] = []
        self._in_flight: list[_Seq] = []
        self._in_flight_prefill: set[int] = set()
        self._cache: list[_CacheEntry] = []
        self._free_ids = list(range(self.n_seq_max - 1, -1, -1))
        self._started = 0
        self._wake = False
        self._closed = False
        self._steps = 0
        self._seqs_stepped = 0
        self._tokens_stepped = 0
        self._aborted = 0
        self._prefix_hits = 0
        self._prefix_tokens = 0
        self._drafted = 0
        self._accepted = 0
        self._last_peers: list[_Seq] = []
        #: seconds a step of n tokens took (moving average, n <= _TIMED_STEP_TOKENS)
        self._step_costs: dict[int, float] = {}
        #: seconds a prompt token costs in a big step (moving average; None: not timed yet)
        self._prompt_cost: float | None = None
        #: when the step in flight is expected to end (monotonic; under ``_lock``)
        self._step_ends = 0.0
        self._drop_cache = False
        self._tokenized = KeptPrompts()
        self._eog: list[int] | None = None
        #: the chat template's head that the warm-up computed and cached (``_warm_up``)
        self._head: list[int] = []

    def _warm_up(self) -> None:
        """One step at load, as llama.cpp's own server does: the weights are paged in
        and the threads started before the first request, whose first token would
        otherwise pay for both, and whose step time would mislead the thread tuner (a
        cold first try of one count made the other look best for prompts). The step
        computes the chat template's head (``_template_head``) and keeps it as a
        prefix-cache entry, so that even the first chat request after a load computes
        only its own part (the default model: 28 of a short question's 44 tokens; its
        first token 40 ms instead of 97 here); without a template or a cache, it
        computes the start and end tokens and keeps nothing.
        On the loop's thread: llama.cpp's OpenMP team belongs to the thread that calls
        ``llama_decode``, and a second team in the process (this one, started by the
        loading thread) would throttle the loop's barriers for good."""
        lib = self._lib
        head = self._template_head()
        if any(entry.tokens[: len(head)] == head for entry in self._cache):
            head = []  # a restored entry starts with it
        ends = (lib.llama_vocab_bos(self._vocab), lib.llama_vocab_eos(self._vocab))
        tokens = head or [int(t) for t in ends if t >= 0] or [0]
        seq_id = self._take_id()
        b = self._batch
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_id
            b.logits[i] = int(i == len(tokens) - 1)
        b.n_tokens = len(tokens)
        kept = lib.llama_decode(self._ctx.ctx, b) == 0 and bool(head)
        b.n_tokens = 0
        if kept:
            self._keep(seq_id, tokens)
            self._head = tokens  # computed again at each load: never saved
        self._free(seq_id)

    def _template_head(self) -> list[int]:
        """The tokens every chat prompt of this model starts with when it brings no
        system message (the template's own start, its default system prompt): the
        common prefix of two one-question prompts. Empty when the prefix cache is off,
        the model has no chat template, or the head is shorter than 2 tokens."""
        if not self.cache_entries or self._formatter is None:
            return []
        try:
            a, b = (
                self.tokenize_request(GenerationRequest.chat([{"role": "user", "content": q}]))
                for q in ("Why?", "How?")
            )
        except Exception:  # a template that cannot render a lone question: no head
            return []
        n = min(_common_prefix(a, b), self.n_batch, self.cache_tokens, self.context_length - 1)
        return a[:n] if n >= 2 else []

    @classmethod
    def load(
        cls, model_path: str | Path, *, load_timeout: float | None = None, **options: Any
    ) -> BatchEngine:
        """Load under ``load_timeout`` seconds; raises ``LoadTimeout`` or ``ModelLoadError``."""
        return load_gguf(lambda: cls(model_path, **options), model_path, load_timeout)

    # -- prompts -----------------------------------------------------------------------------

    def tokenize_request(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens for a request (chat template from the GGUF metadata)."""
        options = template_options(self.reasoning, request.sampling.think)
        return prompt_tokens(self._model, self._formatter, request, self.name, options)

    def count_prompt_tokens(self, request: GenerationRequest | EmbeddingRequest) -> int:
        """Tokenize on the caller's thread and keep the tokens for the loop's admission,
        so the loop (which every running stream waits on) does not template and
        tokenize the same prompt again. An embedding request's inputs are checked."""
        if isinstance(request, EmbeddingRequest):
            return check_inputs(request, self._embedder.info)
        check_request(self._lib, self._vocab, self._n_vocab, request, self.name, self.reasoning)
        tokens = self._tokenized.peek(request)  # counted before (fitting a chat to a window)
        if tokens is None:
            tokens = self.tokenize_request(request)
        self.keep_prompt_tokens(request, tokens)
        return len(tokens)

    def remember_prompt_tokens(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Keep ``tokens``, just made by ``tokenize_request``, for ``request``'s count and
        admission (a chat fitted to its window is not tokenized again)."""
        self._tokenized.keep(request, tokens)

    def keep_prompt_tokens(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Use ``tokens``, made elsewhere (a worker's parent process, with the same
        vocabulary), as the prompt of ``request`` when it is admitted."""
        check_fits(len(tokens), self.context_length)
        self._tokenized.keep(request, tokens)

    def _prompt_of(self, request: GenerationRequest) -> list[int]:
        kept = self._tokenized.take(request)
        return kept if kept is not None else self.tokenize_request(request)

    # -- embeddings (``_embed.py``) -----------------------------------------------------------

    def embedding_info(self) -> EmbeddingInfo:
        return self._embedder.info

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        return input_tokens(self._model, texts)

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[list[int]]:
        return pair_tokens(self._model, query, documents)

    def _embed_ended(self) -> None:
        with self._cond:
            self._started -= 1

    def _start_embedding(
        self, request: EmbeddingRequest, producer: Producer[Any], on_exit: OnExit | None
    ) -> None:
        job = EmbedJob(request, producer, on_exit or (lambda: None))
        with self._cond:
            check_can_start(self._closed, self._started, self.slots, "sequences")
            self._started += 1
        producer.start()
        producer.count_prompt(request.n_tokens)
        with self._cond:
            self._embedder.add(job)
            self._wake = True
            self._cond.notify()
        producer.on_cancel(lambda _reason: self._embedder.cancel(job))

    # -- requests ----------------------------------------------------------------------------

    def start(
        self, request: GenerationRequest, producer: Producer[str], on_exit: OnExit | None = None
    ) -> None:
        """Hand a request to the loop; never blocks. Raises ``IllegalState`` when full."""
        if isinstance(request, EmbeddingRequest):
            self._start_embedding(request, producer, on_exit)
            return
        seq = _Seq(request, producer, on_exit or (lambda: None))
        with self._cond:
            check_can_start(self._closed, self._started, self.slots, "sequences")
            self._started += 1
            self._inbox.append(seq)
            self._wake = True
            self._cond.notify()
        producer.on_cancel(lambda _reason: self._on_cancel(seq))

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        """Blocking: run one request through the loop, as a thread engine does.

        For a caller that wraps the engine in ``belt.produce`` on a thread of its own
        (``tokenbelt probe``, the benchmarks): that wrapper records the end and the
        release, so the loop only reports them here. Returns ``stop``/``length``,
        raises ``Cancelled`` after a stop and the engine's error after a failure.
        """
        return run_to_end(self.start, request, producer)

    def _on_cancel(self, seq: _Seq) -> None:
        """On the cancelling thread: mark the sequence, abort the step if that is all it
        does, and wake the loop so the sequence is released before the next step."""
        with self._cond:
            seq.cancelled = True
            waiting = seq in self._inbox
            if waiting:
                # Not admitted yet: it holds no KV cells, so it can go now, without
                # waiting for the step in flight to end.
                self._inbox.remove(seq)
                self._started -= 1
            in_flight = self._in_flight
            aborts = seq.id in self._in_flight_prefill or all(s.cancelled for s in in_flight)
            if in_flight and any(s is seq for s in in_flight):
                if aborts:
                    self._flag[0] = b"\x01"
                else:
                    self._arm_stop_watch_locked()
            self._wake = True
            self._cond.notify()
        if waiting:
            try:
                seq.on_exit()
            finally:
                seq.producer.release()

    def between_steps(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the engine's thread before its next step (at once when
        it is idle); never blocks. A worker answers its heartbeat this way, so that a
        loop stuck inside a step is seen to be."""
        with self._cond:
            if self._closed:
                return
            self._between.append(callback)
            self._wake = True
            self._cond.notify()

    def around_sampling(self, wrap: Callable[[], AbstractContextManager[None]]) -> None:
        """Sample every step inside ``wrap()`` (set before the first request): what the
        step's sampling puts, ends and releases happens inside it."""
        self._sampling = wrap

    def _room(self) -> None:
        with self._cond:
            self._wake = True
            self._cond.notify()

    def _arm_stop_watch_locked(self) -> None:
        """A stop landed in the step in flight without aborting it: abort it anyway if
        it is still running ``stop_abort_after`` seconds from now (under ``_lock``), or
        at once when this step is expected to run longer than that (waiting first would
        only make the release later, for the same lost step)."""
        now = time.monotonic()
        if self._step_ends - now > self.stop_abort_after:
            if self._flag[0] == b"\x00":
                self._flag[0] = b"\x01"
                self._escalated += 1
            return
        if self._abort_by is None:
            self._abort_by = now + self.stop_abort_after
            self._watch.notify()

    def _watch_stops(self) -> None:
        """The stop watch: a step that runs past its bound after a stop is aborted, so
        one long step never holds a stopped sequence (and no worker is killed for it)."""
        with self._watch:
            while not self._closed:
                due = self._abort_by
                if due is None:
                    self._watch.wait()
                    continue
                left = due - time.monotonic()
                if left > 0:
                    self._watch.wait(left)
                    continue
                self._abort_by = None
                if self._in_flight and self._flag[0] == b"\x00":
                    self._flag[0] = b"\x01"
                    self._escalated += 1
                    logger.debug(
                        "%s: a step ran %.0f ms past a stop: aborted",
                        self.name,
                        self.stop_abort_after * 1000,
                    )

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        broken: BaseException | None = None
        try:
            try:
                # Before the warm-up's first step starts llama.cpp's threads: they inherit it.
                lower_this_thread(self.decode_nice)
                self._restore()
                self._warm_up()
            finally:
                self._warmed.set()
            while self._step_once():
                pass
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            logger.exception("the batch loop of %s failed", self.name)
            broken = exc
            self._loop_failed = True
        finally:
            with self._cond:
                self._closed = True  # nothing serves the inbox any more: refuse new work
                self._watch.notify()
            self._drain(broken)

    def _step_once(self) -> bool:
        """One step: admit, retire, build, decode, sample. False when closed and empty."""
        with self._cond:
            while self._inbox:
                self._active.append(self._inbox.popleft())
            if self._closed and not self._active and not self._embedder.busy:
                return False
            drop, self._drop_cache = self._drop_cache, False
            between, self._between = self._between, []
        for callback in between:
            callback()
        if drop:
            for entry in list(self._cache):
                self._evict(entry)
        for seq in list(self._active):
            if seq.id < 0 and not seq.cancelled:
                self._admit(seq)
        for seq in list(self._active):
            if seq.cancelled or seq.producer.end_reason is not None:
                # A stopped request's computed cells stay as a cache entry (nothing more
                # is computed for it): the same prompt again, or the conversation going on
                # after a Stop, starts from them.
                self._retire(seq, cache=seq.producer.end_reason is not EndReason.RUNTIME_ERROR)
        rows, n_tokens = self._build()
        started = time.perf_counter()
        if n_tokens:
            self._decode(rows, n_tokens)
        # At most one embedding ubatch per step, on a time share beside chat work.
        chat_s = time.perf_counter() - started if n_tokens else None
        if self._embedder.step(self._embedder.budget(chat_s, self.prefill_chunk)) or n_tokens:
            return True
        with self._cond:
            while not self._wake and not self._inbox and not self._closed:
                self._cond.wait()
            self._wake = False
        return True

    def _prepare(self, seq: _Seq) -> bool:
        """Start the request and tokenize its prompt (once); False if it failed."""
        p = seq.producer
        p.start()
        seq.prepared = True
        try:
            check_logit_bias(seq.request.sampling, self._n_vocab, self.name)
            tokens = self._prompt_of(seq.request)
            p.count_prompt(len(tokens))
            check_fits(len(tokens), self.context_length)
        except Exception as exc:
            p.fail(exc)
            self._retire(seq, cache=False)
            return False
        seq.tokens = tokens
        seq.n_prompt = len(tokens)
        seq.max_new = min(seq.request.sampling.max_tokens, self.context_length - len(tokens))
        if self.reasoning is not None and seq.request.messages is not None:
            self._open_phases(seq)
        return True

    # -- the reasoning phase -----------------------------------------------------------------

    def _open_phases(self, seq: _Seq) -> None:
        """Split a thinking model's chat reply; its reasoning may open in the prompt."""
        fmt = self.reasoning
        assert fmt is not None
        s = seq.request.sampling
        opened = fmt.opens_in(self._detokenize(seq.tokens[-8:]))
        seq.phases = PhaseSplitter(fmt, opened)
        # A template without a switch is told "no thinking" by a budget of nothing.
        seq.think_budget = 0 if s.think is False and not fmt.toggle else s.reasoning_budget
        # Room for a forced end marker within the sequence's cells.
        room = self.context_length - len(seq.tokens) - len(fmt.end_tokens)
        seq.max_new = max(1, min(seq.max_new, room))
        if opened and seq.think_budget == 0:
            self._end_reasoning(seq, "budget")  # the marker joins the prompt

    def _detokenize(self, tokens: list[int]) -> str:
        raw = b"".join(self._token_bytes(t, special=True) for t in tokens)
        return raw.decode("utf-8", "replace")

    def _reasoning_started(self, seq: _Seq) -> None:
        seq.producer.note_reasoning(0)
        timeout = seq.request.sampling.reasoning_timeout
        if timeout is not None:
            seq.think_until = time.monotonic() + timeout
            seq.think_timer = _ThinkingDeadline(self, seq)
            self._deadlines.schedule(seq.think_timer, seq.think_until)

    def _thinking_expired(self, seq: _Seq) -> None:
        """On the timer's thread, at a thinking deadline: abort the step in flight when it
        computes only this sequence (the loop then forces the end marker into the next
        step, ``_build``); a step shared with others runs on, so no one else pays."""
        with self._cond:
            if self._in_flight == [seq] and seq.think_until is not None:
                self._flag[0] = b"\x01"
            self._wake = True
            self._cond.notify()

    def _marker_lead(self, decoding: int) -> float:
        """How long before a thinking deadline the end marker must go in, beside
        ``decoding - 1`` other decoding sequences, for the answer's first token to come
        out by the deadline: the step that decodes the marker, plus the plain step the
        loop would run first if it waited (each as timed on this machine: a step of a few
        tokens costs several one-token steps on a CPU). Forced then, the answer comes
        out within a plain step before the deadline; forced one step later, it would
        come up to a step after it."""
        fmt = self.reasoning
        if fmt is None:
            return 0.0
        plain = self._step_cost(decoding) or 0.0
        return plain + (self._step_cost(decoding + len(fmt.end_tokens)) or 0.0)

    def _end_reasoning(self, seq: _Seq, by: str) -> None:
        """End the reasoning phase now (``budget``, ``deadline``): the end marker is
        appended, to be decoded with the next step, and the answer starts after it."""
        phases, fmt = seq.phases, self.reasoning
        assert phases is not None
        assert fmt is not None
        seq.think_until = None
        if phases.state != REASONING:
            return
        phases.end_now()
        seq.tokens.extend(fmt.end_tokens)
        seq.producer.note_reasoning(phases.tokens, by)

    def _split(self, seq: _Seq, phases: PhaseSplitter, token: int, text: str) -> tuple[str, str]:
        """A thinking model's token: (reasoning, answer) text, and the phase's marks."""
        text = self._marker_text.get(token, text)
        was, had = phases.state, phases.opened
        reasoning, answer = phases.feed(text)
        if phases.opened and was == ANSWER and not phases.answered:
            phases.answered = True  # the first token after the end marker: the answer's
            seq.producer.note_answer()
        if not phases.opened or was == ANSWER:
            return reasoning, answer
        if not had or not phases.tokens:
            # Opened by the model's marker, or by the prompt: the clock starts at its
            # first generated token (the prompt's prefill is not thinking).
            self._reasoning_started(seq)
        phases.tokens += 1  # the markers are the reasoning's tokens too
        if phases.state == ANSWER:
            seq.think_until = None
            seq.producer.note_reasoning(phases.tokens, "marker")
        return reasoning, answer

    def _close_phases(self, seq: _Seq) -> None:
        """A request that ends inside its reasoning: the trace gets the phase's count."""
        phases = seq.phases
        if phases is not None and phases.state == REASONING:
            seq.producer.note_reasoning(phases.tokens)
            phases.state = ANSWER  # counted once

    def _follows(self, seq: _Seq) -> bool:
        """True while another sequence is still computing prompt cells this one can copy:
        the choices of one request (``n``), or the same prompt sent twice, compute their
        shared prompt once. A leader that waits for its reader is not waited for."""
        if not self.cache_entries or not seq.request.reuse_prefix:
            return False  # the prefix cache is off (or this request computes its prompt)
        limit = len(seq.tokens) - 1
        for other in self._active:
            if other is seq or other.id < 0 or other.cancelled or other.decoding:
                continue
            if other.waiting_room:
                continue
            if min(_common_prefix(other.tokens, seq.tokens), limit) > other.n_past:
                return True
        return False

    def _admit(self, seq: _Seq) -> None:
        """Tokenize, find a cached prefix, take a sequence id, build the sampler; or wait
        a step while a sequence ahead computes the prompt this one shares."""
        if not seq.prepared and not self._prepare(seq):
            return
        if self._follows(seq):
            return
        p = seq.producer
        tokens = seq.tokens
        seq.id = self._take_id()
        seq.sampler = self._sampler(seq.request.sampling)
        if seq.request.grammar is not None:
            try:
                seq.grammar = GrammarSampler(
                    self._lib, self._vocab, self._n_vocab, seq.request.grammar
                )
            except Exception as exc:
                p.fail(exc)
                self._retire(seq, cache=False)
                return
        drafts = (seq.request.draft or self.draft) == "lookup"
        if drafts and seq.grammar is None and seq.phases is None:
            seq.lookup = Lookup()
        reuse, source, entry = 0, -1, None  # cache_prompt: false computes the whole prompt
        if seq.request.reuse_prefix:
            reuse, source, entry = self._best_prefix(tokens, exclude=seq)
        if entry is not None:
            if not self._load_entry(entry, seq.id, reuse):
                reuse = 0  # its cells did not go back in: the prompt is computed
        elif reuse > 0:
            self._lib.llama_memory_seq_cp(self._mem, source, seq.id, 0, reuse)
        if reuse > 0:
            seq.n_past = reuse
            p.count_cached(reuse)
            self._prefix_hits += 1
            self._prefix_tokens += reuse

    def _take_id(self) -> int:
        if not self._free_ids:  # pragma: no cover - at most ``slots`` requests hold one
            raise IllegalState("no free sequence id")
        return self._free_ids.pop()

    def _best_prefix(self, tokens: list[int], exclude: _Seq) -> tuple[int, int, _CacheEntry | None]:
        """The longest usable cached prefix: (tokens, the running sequence that holds
        them or -1, the cache entry that holds them or None).

        A cache entry that serves moves to the end of ``_cache``, which is kept in order
        of use: the first entry is always the least recently used.
        """
        best, source, hit = 0, -1, None
        if not self.cache_entries:
            return best, source, hit  # the prefix cache is off: every prompt is computed
        limit = len(tokens) - 1  # at least one prompt token must be evaluated for logits
        for entry in self._cache:
            n = min(_common_prefix(entry.tokens, tokens), limit)
            if n > best:
                best, hit = n, entry
        for seq in self._active:
            if seq is exclude or seq.id < 0 or seq.cancelled:
                continue
            n = min(_common_prefix(seq.tokens[: seq.n_past], tokens), limit)
            if n > best:
                best, source, hit = n, seq.id, None
        if hit is not None:
            self._cache.remove(hit)
            self._cache.append(hit)
        return best, source, hit

    def _sampler(self, s: SamplingParams) -> Any:
        """The sampler chain: bias, penalties, then greedy or top-k/top-p/min-p/temperature."""
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if s.logit_bias:
            biases = (lib.llama_logit_bias * len(s.logit_bias))(*s.logit_bias)
            lib.llama_sampler_chain_add(
                chain, lib.llama_sampler_init_logit_bias(self._n_vocab, len(biases), biases)
            )
        if s.repeat_penalty != 1.0 and s.repeat_last_n != 0:
            last_n = self.context_length if s.repeat_last_n < 0 else s.repeat_last_n
            lib.llama_sampler_chain_add(
                chain,
                lib.llama_sampler_init_penalties(self._n_vocab, last_n, s.repeat_penalty, 0.0, 0.0),
            )
        if s.frequency_penalty or s.presence_penalty:
            # OpenAI counts every token generated so far: the window is the whole sequence.
            lib.llama_sampler_chain_add(
                chain,
                lib.llama_sampler_init_penalties(
                    self._n_vocab, self.context_length, 1.0, s.frequency_penalty, s.presence_penalty
                ),
            )
        if s.temperature == 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(s.top_k))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(s.top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(s.min_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(s.temperature))
        seed = s.seed if s.seed is not None else random.getrandbits(31)
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        return chain

    def _build(self) -> tuple[list[tuple[_Seq, int, int]], int]:
        """Fill the batch: (sequence, tokens it adds, row of its logits or -1), count."""
        b = self._batch
        rows: list[tuple[_Seq, int, int]] = []
        n = 0

        def add(seq: _Seq, k: int, draft: list[int] | None = None) -> None:
            nonlocal n
            end = seq.n_past + k
            for j, token in enumerate(seq.tokens[seq.n_past : end]):
                i = n + j
                b.token[i] = token
                b.pos[i] = seq.n_past + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq.id
                b.logits[i] = 0
            last = -1
            if end == len(seq.tokens):
                last = n + k - 1
                b.logits[last] = 1
            seq.draft = draft or []
            for j, token in enumerate(seq.draft):  # every draft row is sampled
                i = n + k + j
                b.token[i] = token
                b.pos[i] = end + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq.id
                b.logits[i] = 1
            rows.append((seq, k + len(seq.draft), last))
            n += k + len(seq.draft)

        active = [s for s in self._active if s.id >= 0 and not s.cancelled]
        decoding = [s for s in active if s.decoding]
        now = time.monotonic()
        stepping: list[_Seq] = []
        for seq in decoding:
            if seq.think_until is not None and now + self._marker_lead(len(decoding)) >= (
                seq.think_until
            ):
                # Its end marker goes in this step: waiting one more would put the
                # answer's first token past the deadline.
                self._end_reasoning(seq, "deadline")
            if seq.producer.has_room():
                stepping.append(seq)
            else:
                self._wait_room(seq)
        for i, seq in enumerate(stepping):
            # One token, or more when the engine appended some (a forced end marker).
            k = len(seq.tokens) - seq.n_past
            draft = None
            if seq.lookup is not None and k == 1:
                # Room in the batch for this draft and one token for every sequence after it.
                spare = self.n_batch - n - k - (len(stepping) - i - 1)
                draft = self._draft_for(seq, len(stepping), spare)
            add(seq, k, draft)
        plain = n - sum(len(seq.draft) for seq in stepping)
        # Drafts do not take the prompts' share of a step, only the batch's room.
        budget = min((self.prompt_chunk() if decoding else self.n_batch) - plain, self.n_batch - n)
        for seq in active:
            if seq.decoding or budget <= 0:
                continue
            k = min(budget, len(seq.tokens) - seq.n_past)
            if seq.n_past + k == len(seq.tokens) and not seq.producer.has_room():
                self._wait_room(seq)
                continue
            add(seq, k)
            budget -= k
        b.n_tokens = n
        return rows, n

    def prompt_chunk(self) -> int:
        """The most tokens a step carries while sequences decode: what the measured
        prompt rate fits in ``prefill_gap``, at least ``prefill_chunk``, at most a batch
        with a row for every slot."""
        chunk = self.prefill_chunk
        cost = self._prompt_cost
        if self.prefill_gap > 0 and cost is not None and cost > 0:
            chunk = max(chunk, int(self.prefill_gap / cost))
        return min(chunk, self.n_batch - self.slots)

    def _draft_for(self, seq: _Seq, batch: int, spare: int) -> list[int] | None:
        """The draft to verify with the sequence's pending token in a step of ``batch``
        decoding sequences: a prompt lookup, as long as it pays (``_draft.py``), within
        the belt's room, the reply's length and the batch's ``spare`` rows."""
        lookup = seq.lookup
        assert lookup is not None
        lookup.settle(seq.tokens)
        # Each accepted token and the correction go on the belt in this step.
        limit = min(
            self.draft_tokens, seq.max_new - seq.produced - 1, seq.producer.room() - 1, spare
        )
        proposal = lookup.propose(seq.tokens, limit)
        if not proposal:
            return None
        length = best_length(lookup.rate, batch, len(proposal), self._step_cost)
        if length == 0:
            length = lookup.probe(seq.produced, len(proposal))
        if length == 0:
            lookup.shadow(seq.tokens, proposal)  # measured for free: it may pay later
            return None
        lookup.drop_shadow()
        return proposal[:length]

    def _step_cost(self, n: int) -> float | None:
        """Seconds a step of ``n`` tokens is expected to take: as timed here, else by a
        straight line through the nearest sizes timed (None: nothing timed yet)."""
        costs = self._step_costs
        one = costs.get(1)
        # No step costs more than its tokens one at a time: a step timed while the machine
        # stalled would otherwise keep drafts of that size off for good.
        most = float("inf") if one is None else n * one
        known = costs.get(n)
        if known is not None:
            return min(known, most)
        sizes = sorted(costs)
        if not sizes:
            return None
        if len(sizes) == 1:
            # One size timed: each token past the first about half a one-token step.
            m = sizes[0]
            return costs[m] * (n + 1) / (m + 1)
        below = [m for m in sizes if m < n]
        above = [m for m in sizes if m > n]
        if below and above:
            lo, hi = below[-1], above[0]
        elif below:
            lo, hi = sizes[-2], sizes[-1]
        else:
            lo, hi = sizes[0], sizes[1]
        slope = max(0.0, (costs[hi] - costs[lo]) / (hi - lo))
        return min(most, max(1e-6, costs[lo] + slope * (n - lo)))

    def _wait_room(self, seq: _Seq) -> None:
        """Leave a full sequence out; the read that makes room wakes the loop."""
        if seq.waiting_room:
            return
        seq.waiting_room = seq.producer.on_room(self._room)
        if not seq.waiting_room:
            self._room()  # room came (or the belt ended) since we looked: step again

    def _decode(self, rows: list[tuple[_Seq, int, int]], n_tokens: int) -> None:
        lib = self._lib
        with self._cond:
            self._flag[0] = b"\x00"
            self._in_flight = [seq for seq, _, _ in rows]
            self._in_flight_prefill = {seq.id for seq, _, _ in rows if not seq.decoding}
            self._step_ends = time.monotonic() + (self._step_cost(n_tokens) or 0.0)
            for seq in self._in_flight:
                seq.waiting_room = False
            self._abort_by = None
            if any(s.cancelled for s in self._in_flight):
                if all(s.cancelled for s in self._in_flight) or any(
                    s.cancelled and s.id in self._in_flight_prefill for s in self._in_flight
                ):
                    self._flag[0] = b"\x01"
                else:
                    self._arm_stop_watch_locked()
        kind = (
            "decode"
            if n_tokens <= self.slots and all(s.decoding for s in self._in_flight)
            else "prefill"
        )
        threads = 0
        if self._tuner is not None:
            threads = self._tuner.choose(kind)
            self._ctx_threads = set_threads(lib, self._ctx.ctx, threads, self._ctx_threads)
        started = time.perf_counter()
        ret = lib.llama_decode(self._ctx.ctx, self._batch)
        took = time.perf_counter() - started
        if ret == 0:
            if self._tuner is not None:
                self._tuner.record(kind, threads, took, n_tokens)
            if n_tokens <= _TIMED_STEP_TOKENS:  # small steps: what a forced marker costs
                self._step_costs[n_tokens] = _moving(self._step_costs.get(n_tokens), took)
            if kind == "prefill" and n_tokens >= _PROMPT_TIMED_TOKENS:
                self._prompt_cost = _moving(self._prompt_cost, took / n_tokens)
        with self._cond:
            self._in_flight = []
            self._in_flight_prefill = set()
            self._abort_by = None  # this step is over: the stop watch has nothing to abort
        self._steps += 1
        self._seqs_stepped += len(rows)
        self._tokens_stepped += n_tokens
        if ret != 0:
            self._recover(rows, ret)
            return
        for seq, k, _ in rows:
            seq.n_past += k - len(seq.draft)  # a draft's cells count once verified
        if len(rows) > 1:
            self._note_peers(rows)
        with self._sampling():
            for seq, _, row in rows:
                if row >= 0 and not seq.cancelled:
                    if seq.draft:
                        self._verify(seq, row)
                    else:
                        self._sample(seq, row)
                elif seq.draft:
                    self._drop_draft(seq)

    def _verify(self, seq: _Seq, row: int) -> None:
        """Sample the pending token's row, then each draft row while the sample equals
        the draft token: each accepted token's cell is kept, the first sample that
        differs is the correction (the next pending token), the rest of the draft's
        cells are removed. Every token is the sampler's own (``_sample``), so its end
        tokens, stop strings, ``max_tokens`` and belt puts apply to each in turn."""
        draft = seq.draft
        lookup = seq.lookup
        assert lookup is not None
        # Counted before the walk: a token of it may end the request (and its trace).
        self._drafted += len(draft)
        lookup.drafted += len(draft)
        accepted = 0
        for i in range(len(draft) + 1):
            if seq.cancelled or not seq.producer.has_room():
                break  # the rest is not sampled: its cells go below
            self._sample(seq, row + i)
            if seq.id < 0:
                break  # it ended (an end token, a stop string, its length, a failure)
            if i == len(draft) or seq.tokens[-1] != draft[i]:
                break  # the correction, or the token after a draft accepted whole
            seq.n_past += 1  # the draft token's cell holds what was sampled
            accepted += 1
            self._accepted += 1
            lookup.accepted += 1
        lookup.observe(accepted, accepted < len(draft))
        self._drop_draft(seq)

    def _drop_draft(self, seq: _Seq) -> None:
        """Remove the cells past the sequence's verified tokens (an unaccepted draft)."""
        seq.draft = []
        if seq.id >= 0:
            self._lib.llama_memory_seq_rm(self._mem, seq.id, seq.n_past, -1)

    def _note_peers(self, rows: list[tuple[_Seq, int, int]]) -> None:
        """Record in each trace which requests shared a step with it (when that changes)."""
        seqs = [seq for seq, _, _ in rows]
        if seqs == self._last_peers:
            return
        self._last_peers = seqs
        ids = [seq.producer.trace.request_id for seq in seqs]
        for seq, own in zip(seqs, ids, strict=True):
            peers = seq.producer.trace.batched_with
            if len(peers) < _MAX_PEERS:
                peers.update(i for i in ids if i != own)

    def _recover(self, rows: list[tuple[_Seq, int, int]], ret: int) -> None:
        """After an aborted or failed step: every sequence goes on from where its KV ends."""
        self._aborted += 1
        for seq, _, _ in rows:
            kept = int(self._lib.llama_memory_seq_pos_max(self._mem, seq.id)) + 1
            # Never past the tokens it holds: a draft's cells are not its tokens.
            seq.n_past = min(kept, len(seq.tokens))
            if seq.draft or kept > seq.n_past:
                self._drop_draft(seq)
        if ret == 2:
            return  # aborted for a stop: the cancelled sequences leave at the next step
        error = DecodeError(f"llama.cpp decode failed (code {ret})")
        for seq, _, _ in rows:
            if not seq.cancelled:
                seq.producer.fail(error)
            self._retire(seq, cache=False)

    def _sample(self, seq: _Seq, row: int) -> None:
        lib = self._lib
        p = seq.producer
        phases = seq.phases
        # A grammar (a schema, a tool call) shapes the answer: reasoning comes first, free.
        if seq.grammar is not None and (phases is None or phases.state == ANSWER):
            try:
                token = seq.grammar.sample(seq.sampler, self._ctx.ctx, row)
            except DecodeError as exc:  # this sequence fails; the others go on
                p.fail(exc)
                self._retire(seq, cache=False)
                return
        else:
            s = seq.request.sampling
            if s.ignore_eos or seq.produced < s.min_tokens:
                token = self._sample_without_end(seq, row)
            else:
                token = int(lib.llama_sampler_sample(seq.sampler, self._ctx.ctx, row))
        if lib.llama_vocab_is_eog(self._vocab, token):
            reasoning, tail = self._tail(seq)
            self._end(seq, self._parts(tail, reasoning), EndReason.STOP)
            return
        seq.produced += 1
        p.count_token()
        raw = self._token_bytes(token)
        text = seq.decoder.decode(raw)
        reasoning = ""
        if phases is not None:
            reasoning, text = self._split(seq, phases, token, text)
        # Stop strings are the answer's: the reasoning part never reaches them.
        text, hit = seq.stopper.feed(text)
        if hit:
            seq.producer.trace.stop_sequence = seq.stopper.matched
            self._end(seq, self._scored(seq, text, token, raw, row, reasoning), EndReason.STOP)
        elif seq.produced >= seq.max_new:
            more, tail = self._tail(seq)
            piece = self._scored(seq, text + tail, token, raw, row, reasoning + more)
            self._end(seq, piece, EndReason.LENGTH)
        else:
            seq.tokens.append(token)
            if (
                phases is not None
                and phases.state == REASONING
                and seq.think_budget is not None
                and phases.tokens >= seq.think_budget
            ):
                self._end_reasoning(seq, "budget")
            self._put(seq, self._scored(seq, text, token, raw, row, reasoning))

    def _end_tokens(self) -> list[int]:
        """Every end-of-generation token of the vocabulary (found once, when first asked)."""
        if self._eog is None:
            lib, vocab = self._lib, self._vocab
            self._eog = [t for t in range(self._n_vocab) if lib.llama_vocab_is_eog(vocab, t)]
        return self._eog

    def _sample_without_end(self, seq: _Seq, row: int) -> int:
        """Sample with every end token's logit at -inf (``ignore_eos``, ``min_tokens``), as
        llama.cpp's server bans them; the logits are put back after, so the log-probabilities
        stay the model's own."""
        logits = self._lib.llama_get_logits_ith(self._ctx.ctx, row)
        ends = self._end_tokens()
        kept = [logits[t] for t in ends]
        for t in ends:
            logits[t] = float("-inf")
        try:
            return int(self._lib.llama_sampler_sample(seq.sampler, self._ctx.ctx, row))
        finally:
            for t, value in zip(ends, kept, strict=True):
                logits[t] = value

    def _token_bytes(self, token: int, *, special: bool = False) -> bytes:
        n = self._lib.llama_token_to_piece(self._vocab, token, self._piece, 256, 0, special)
        return self._piece.raw[: max(n, 0)]

    @staticmethod
    def _parts(text: str, reasoning: str) -> str:
        """A thinking model's text as it goes on the belt: a ``Piece`` when it carries
        reasoning, else the plain string."""
        return Piece(text, (), reasoning) if reasoning else text

    def _scored(
        self, seq: _Seq, text: str, token: int, raw: bytes, row: int, reasoning: str = ""
    ) -> str:
        """``text`` as it goes on the belt: a ``Piece`` with the token's log-probability
        and id when the request asked for them (and its reasoning text, for a thinking
        model), else the plain string (the cheap path)."""
        s = seq.request.sampling
        ids = (token,) if s.return_token_ids else ()
        if not s.logprobs:
            return Piece(text, (), reasoning, ids) if reasoning or ids else text
        import numpy as np

        pointer = self._lib.llama_get_logits_ith(self._ctx.ctx, row)
        logits = np.ctypeslib.as_array(pointer, shape=(self._n_vocab,)).astype(np.float64)
        peak = logits.max()
        logprobs = logits - (peak + np.log(np.exp(logits - peak).sum()))
        top: tuple[TokenLogprob, ...] = ()
        if s.top_logprobs:
            k = min(s.top_logprobs, self._n_vocab)
            best = np.argpartition(-logprobs, k - 1)[:k]
            best = best[np.argsort(-logprobs[best], kind="stable")]
            top = tuple(self._logprob(int(t), float(logprobs[t])) for t in best)
        chosen = TokenLogprob(raw.decode("utf-8", "replace"), float(logprobs[token]), raw, top)
        return Piece(text, (chosen,), reasoning, ids)

    def _logprob(self, token: int, logprob: float) -> TokenLogprob:
        raw = self._token_bytes(token)
        return TokenLogprob(raw.decode("utf-8", "replace"), logprob, raw)

    @staticmethod
    def _tail(seq: _Seq) -> tuple[str, str]:
        """What the reply held back when it ends: (reasoning, answer)."""
        answer = held_back(seq.stopper, seq.decoder)
        if seq.phases is None:
            return "", answer
        reasoning, more = seq.phases.flush()
        return reasoning, answer + more

    def _put(self, seq: _Seq, text: str) -> bool:
        try:
            seq.producer.put_nowait(text)
        except Cancelled:
            return False
        return True

    def _end(self, seq: _Seq, text: str, reason: EndReason) -> None:
        self._close_phases(seq)
        if self._put(seq, text):
            seq.producer.finish(reason)
        self._retire(seq, cache=reason.is_natural)

    def _retire(self, seq: _Seq, *, cache: bool) -> None:
        """Run the sequence's exit hook and release it, then copy its cells into the
        prefix cache (when it is cached) and free them. The copy comes after the
        release: it takes milliseconds for a long sequence (about 23 KB a token on the
        default model), and a stop's release must not wait for the cache. Nothing else
        runs on this thread meanwhile: the cells are still whole when they are copied."""
        if seq in self._active:
            self._active.remove(seq)
        if seq.sampler is not None:
            self._lib.llama_sampler_free(seq.sampler)
            seq.sampler = None
        if seq.grammar is not None:
            seq.grammar.free()
            seq.grammar = None
        self._close_phases(seq)
        seq.think_until = seq.think_timer = None
        if seq.lookup is not None:
            seq.producer.count_draft(seq.lookup.drafted, seq.lookup.accepted)
        if seq.draft or seq.lookup is not None:
            self._drop_draft(seq)  # a cache entry holds its verified tokens only
        held, seq.id = seq.id, -1
        if seq.producer.end_reason is None:  # pragma: no cover - every path ends it first
            seq.producer.cancel(EndReason.SHUTDOWN)
        with self._cond:
            self._started -= 1
        try:
            seq.on_exit()
        finally:
            seq.producer.release()
            if held >= 0:
                if cache and self.cache_entries and seq.n_past > 0:
                    # Longer than the cache holds: its head, where another turn starts too.
                    kept = min(seq.n_past, self.cache_tokens)
                    if kept < seq.n_past:
                        self._lib.llama_memory_seq_rm(self._mem, held, kept, -1)
                    self._keep(held, seq.tokens[:kept])
                self._free(held)

    # -- prefix cache ------------------------------------------------------------------------

    def _keep(self, seq_id: int, tokens: list[int]) -> None:
        """Copy sequence ``seq_id``'s cells (holding ``tokens``) out of the KV cache into
        a cache entry; the caller frees the cells. Kept there, they would cost every
        step: each row of a step looks at every cell up to the highest one in use (a
        lone stream of the default model: 156 tok/s with the cache empty, 112 with 8
        entries kept as cells)."""
        lib, ctx = self._lib, self._ctx.ctx
        size = int(lib.llama_state_seq_get_size(ctx, seq_id))
        state = (ctypes.c_uint8 * size)()
        if size == 0 or int(lib.llama_state_seq_get_data(ctx, state, size, seq_id)) != size:
            logger.warning("%s: llama.cpp gave no state for a prefix-cache entry", self.name)
            return
        self._add_entry(tokens, state)

    def _add_entry(self, tokens: list[int], state: Any) -> None:
        """A cache entry, the most recently used; the least recently used go past the
        limits."""
        self._cache.append(_CacheEntry(tokens, state))  # the most recently used: last
        while len(self._cache) > self.cache_entries or (
            sum(len(e.tokens) for e in self._cache) > self.cache_tokens
        ):
            self._evict(self._cache[0])

    def _set_state(self, seq_id: int, tokens: list[int], state: Any) -> bool:
        """Put ``state`` into sequence ``seq_id``'s cells; whether they now hold exactly
        the positions of ``tokens`` (else they would serve a prefix they do not hold)."""
        lib = self._lib
        got = lib.llama_state_seq_set_data(self._ctx.ctx, state, len(state), seq_id)
        return got != 0 and int(lib.llama_memory_seq_pos_max(self._mem, seq_id)) + 1 == len(tokens)

    def _accepts(self, tokens: list[int], state: Any) -> bool:
        """Whether llama.cpp takes ``state`` as the cells of ``tokens``: checked in a free
        sequence, freed again (a saved entry, read back before any request runs)."""
        seq_id = self._take_id()
        try:
            return self._set_state(seq_id, tokens, state)
        finally:
            self._free(seq_id)

    def _load_entry(self, entry: _CacheEntry, seq_id: int, reuse: int) -> bool:
        """Put ``entry``'s cells back as sequence ``seq_id``'s first ``reuse`` tokens;
        False (and nothing left in it) when llama.cpp did not take them."""
        mem = self._mem
        if not self._set_state(seq_id, entry.tokens, entry.state):
            self._lib.llama_memory_seq_rm(mem, seq_id, -1, -1)
            logger.warning("%s: a prefix-cache entry did not go back in; dropped", self.name)
            self._evict(entry)
            return False
        self._lib.llama_memory_seq_rm(mem, seq_id, reuse, -1)
        return True

    def _evict(self, entry: _CacheEntry) -> None:
        self._cache.remove(entry)

    def _free(self, seq_id: int) -> None:
        """Free sequence ``seq_id``'s cells and the id."""
        self._lib.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        self._free_ids.append(seq_id)

    def _restore(self) -> None:
        """The loop's first job, before the warm-up: the entries saved at the last close
        of this model become cache entries (most recently used last, as ``_cache`` is)."""
        if self._store is None:
            return
        restored = self._store.restore(
            self._accepts,
            max_entries=self.cache_entries,
            max_tokens=self.cache_tokens,
            max_entry_tokens=self.context_length,
            n_vocab=self._n_vocab,
        )
        for entry in reversed(restored):
            # Held in memory as every entry is: the state llama.cpp just took, as read.
            self._add_entry(entry.tokens, entry.state)
        self._restored = (len(restored), sum(len(e.tokens) for e in restored))
        if restored:
            logger.info(
                "%s: %d prefix-cache entries (%d tokens) restored from %s",
                self.name,
                *self._restored,
                self._store.dir,
            )

    def _save(self) -> None:
        """At close, with the loop ended: write the cache entries, most recent first."""
        if self._store is None or self._loop_failed:
            return
        entries = [(e.tokens, e.state) for e in reversed(self._cache) if e.tokens != self._head]
        self._saved = self._store.save(entries)
        if self._saved[0]:
            logger.info(
                "%s: %d prefix-cache entries (%d bytes) saved to %s",
                self.name,
                *self._saved,
                self._store.dir,
            )

    def clear_prefix_cache(self) -> None:
        """Drop every prefix-cache entry before the next step (thread-safe, non-blocking).

        Sampling with a ``seed`` repeats its text only when the computation repeats:
        llama.cpp's kernels round differently for one token than for a batch of them,
        so a prompt served partly from the cache (or beside other sequences) may
        sample differently from the same prompt computed cold and alone.
        """
        with self._cond:
            self._drop_cache = True
            self._wake = True
            self._cond.notify()

    # -- lifecycle ---------------------------------------------------------------------------

    def wrap_abort_hook(self, hook: Callable[[bool], bool]) -> None:
        """Test-only: replace the native abort hook by a Python one. llama.cpp calls
        ``hook(stopped)`` between graph nodes, ``stopped`` being what the native hook
        would have read (a stop asked for this step); the step aborts when it returns
        True. The worker's crash tests abort the process from inside a step with it."""
        flag = self._flag

        def native(_data: Any) -> bool:
            return hook(bool(flag[0] == b"\x01"))

        # Kept on the engine: the native side holds a pointer to it.
        self._abort_callback = self._lib.ggml_abort_callback(native)
        self._lib.llama_set_abort_callback(self._ctx.ctx, self._abort_callback, None)

    @property
    def threads(self) -> int:
        """The thread count of the latest step (the tuner's choice, or the fixed count)."""
        return self._tuner.current if self._tuner is not None else self.n_threads

    def statistics(self) -> BatchStatistics:
        with self._cond:
            running = len(self._active) + len(self._inbox) + self._embedder.running
        return BatchStatistics(
            slots=self.slots,
            running=running,
            steps=self._steps,
            sequences_stepped=self._seqs_stepped,
            tokens_stepped=self._tokens_stepped,
            aborted_steps=self._aborted,
            stop_aborted_steps=self._escalated,
            prefix_hits=self._prefix_hits,
            prefix_cached_tokens=self._prefix_tokens,
            cache_entries=len(self._cache),
            threads=self.threads,
            restored_entries=self._restored[0],
            restored_tokens=self._restored[1],
            saved_entries=self._saved[0],
            saved_bytes=self._saved[1],
            draft_tokens=self._drafted,
            accepted_draft_tokens=self._accepted,
        )

    def _drain(self, error: BaseException | None) -> None:
        """The loop ended: end and release whatever is left (a bug or a close)."""
        with self._cond:
            left = list(self._active) + list(self._inbox)
            self._active.clear()
            self._inbox.clear()
        for seq in left:
            if error is not None:
                seq.producer.fail(DecodeError(f"the batch loop failed: {error}"))
            else:
                seq.producer.cancel(EndReason.SHUTDOWN)
            self._retire(seq, cache=False)
        self._embedder.drain(error)

    def close(self) -> None:
        """Stop the loop (running requests end ``shutdown``), save the prefix cache (with
        a ``prefix_cache_dir``: blocks on that write, bounded by ``prefix_cache_disk``),
        then free native memory."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for seq in list(self._active) + list(self._inbox):
                seq.cancelled = True
            self._flag[0] = b"\x01"
            self._cond.notify()
            self._watch.notify()
        self._embedder.stop_all()
        for seq in list(self._active):
            seq.producer.cancel(EndReason.SHUTDOWN)
        self._thread.join()
        self._watcher.join()
        self._embedder.close()
        self._deadlines.close()
        lib = self._lib
        self._save()
        for entry in list(self._cache):
            self._evict(entry)
        lib.llama_set_abort_callback(self._ctx.ctx, lib.ggml_abort_callback(), None)
        lib.llama_batch_free(self._batch)
        self._ctx.close()
        self._model.close()
