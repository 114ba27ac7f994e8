"""The batch engine: many sequences in one llama.cpp context, one decode loop.

One engine thread runs the loop. Each step builds one ``llama_batch`` from

- one decode token for every running sequence whose belt has room: a full belt
  leaves its sequence out of the step (a slow reader pauses only its own stream
  and costs no compute) and asks to be woken when a read makes room;
- prompt chunks of admitted sequences, up to ``prefill_chunk`` tokens per step
  while any sequence is decoding (so a long new prompt does not freeze running
  streams), or up to ``n_batch`` when none is (the fastest first token).

Where a stop lands, per sequence:

- a cancelled sequence leaves before the next step: its KV cells are freed and its
  release is recorded then (within one batched step of the stop);
- a running ``llama_decode`` is aborted through llama.cpp's abort hook only when
  every sequence in it is cancelled, or when it carries the cancelled sequence's own
  prompt chunk. llama.cpp then drops that step's cells, and every surviving
  sequence goes on from where its KV ends (``llama_memory_seq_pos_max``): a stop
  never ends, corrupts or errors another stream.

Prefix cache: a sequence that ends naturally keeps its KV cells as a cache entry
(up to ``cache_entries`` entries and ``cache_tokens`` tokens, least recently used
evicted first). A new request whose prompt shares a prefix with an entry or with a
running sequence copies those cells (``llama_memory_seq_cp``, no compute) and
evaluates only the rest; ``trace.cached_tokens`` says how many it reused.
``cache_entries=0`` turns the cache off: every prompt is then computed in full, so
identical prompts give identical greedy text whatever ran before or beside them.

The KV cache is one unified buffer of ``slots * n_ctx + cache_tokens`` cells: each
sequence may hold up to ``n_ctx`` tokens (prompt and reply), and shared prefixes
take their cells once.
"""

from __future__ import annotations

import codecs
import collections
import ctypes
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._errors import (
    Cancelled,
    DecodeError,
    IllegalState,
    InvalidArgument,
    ModelLoadError,
    PromptTooLong,
)
from ...belt import EndReason, Producer
from .._base import OnExit, check_can_start, run_to_end
from .._request import GenerationRequest, Piece, SamplingParams, TokenLogprob
from .._statistics import BatchStatistics
from ._binding import flag_abort_callback, quiet_native_logs
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
from ._threads import (
    ThreadTuner,
    check_threads,
    default_threads,
    system_load,
    thread_candidates,
    usable_cores,
)

logger = logging.getLogger("tokenbelt.engines.batch")

#: last tokens the repeat penalty looks at (llama-cpp-python's ``last_n_tokens_size``)
_PENALTY_LAST_N = 64
#: at most this many other requests are named in one trace's ``batched_with``
_MAX_PEERS = 32
#: prompts tokenized by ``count_prompt_tokens`` and kept for their admission
_MAX_TOKENIZED = 256


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


class _Seq:
    """One admitted request: its tokens, its place in the KV cache, its sampler."""

    __slots__ = (
        "cancelled",
        "decoder",
        "grammar",
        "id",
        "max_new",
        "n_past",
        "n_prompt",
        "on_exit",
        "prepared",
        "produced",
        "producer",
        "request",
        "sampler",
        "stopper",
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

    @property
    def decoding(self) -> bool:
        return self.produced > 0 or len(self.tokens) > self.n_prompt


class _CacheEntry:
    __slots__ = ("id", "tokens")

    def __init__(self, seq_id: int, tokens: list[int]) -> None:
        self.id = seq_id
        self.tokens = tokens


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
    lib: Any, vocab: Any, n_vocab: int, request: GenerationRequest, name: str
) -> None:
    """What only the model can check, before a request queues: ``logit_bias`` names
    tokens of its vocabulary, and a grammar parses against it (``InvalidArgument``)."""
    check_logit_bias(request.sampling, n_vocab, name)
    if request.grammar is not None:
        check_grammar(lib, vocab, request.grammar)


class BatchEngine:
    """One llama.cpp context serving up to ``slots`` requests at once, batched.

    ``start(request, producer, on_exit)`` never blocks: the engine thread admits the
    request at its next step. For each request the engine calls ``producer.start()``
    when it is admitted, ``finish``/``fail`` (or sees the producer's cancel), then
    ``on_exit()`` and ``producer.release()`` once its KV cells are free or cached.
    At most ``slots`` requests may be started and not yet released.
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
        cache_entries: int = 8,
        cache_tokens: int = 4096,
        name: str | None = None,
        force_n_ctx: bool = False,
    ) -> None:
        import llama_cpp
        from llama_cpp import _internals

        path = check_gguf_file(model_path)
        quiet_native_logs()
        self._lib: Any = llama_cpp
        self.model_path = path
        self.name = name or path.stem
        self.slots = max(1, slots)
        self.context_length = n_ctx
        self.n_batch = max(n_batch, self.slots + 1)
        self.prefill_chunk = max(1, min(prefill_chunk, self.n_batch - self.slots))
        self.cache_entries = max(0, cache_entries)
        self.cache_tokens = max(0, cache_tokens) if self.cache_entries else 0
        threads, threads_batch = default_threads()
        self.n_threads = check_threads("n_threads", n_threads) or threads
        self.n_threads_batch = check_threads("n_threads_batch", n_threads_batch) or threads_batch
        # Thread counts given by the caller are kept; the default adapts to the machine.
        self._tuner = (
            ThreadTuner(thread_candidates(usable_cores(), system_load()))
            if n_threads is None and n_threads_batch is None
            else None
        )
        self.n_seq_max = self.slots + self.cache_entries
        try:
            mparams = llama_cpp.llama_model_default_params()
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
            cparams.n_ctx = self.slots * n_ctx + self.cache_tokens
            cparams.n_batch = self.n_batch
            cparams.n_ubatch = self.n_batch  # one ubatch per step: an abort drops it whole
            cparams.n_seq_max = self.n_seq_max
            cparams.kv_unified = True  # shared prefixes take their cells once
            # Off, as llama-cpp-python's ``Llama`` has it: llama.cpp's "auto" turns flash
            # attention on for the CPU, and with it the default model's greedy text came
            # out different from (and worse than) the single-context engine's.
            cparams.flash_attn_type = 0
            cparams.n_threads = self.n_threads
            cparams.n_threads_batch = self.n_threads_batch
            self._ctx: Any = _internals.LlamaContext(
                model=self._model, params=cparams, verbose=True
            )
        except InvalidArgument:
            raise
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load {path}: {exc}") from exc
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
        # The abort hook reads this flag natively; the loop clears it before each step.
        self._flag = ctypes.create_string_buffer(2)
        self._abort_callback = flag_abort_callback()
        llama_cpp.llama_set_abort_callback(
            self._ctx.ctx, self._abort_callback, ctypes.cast(self._flag, ctypes.c_void_p)
        )
        self._cond = threading.Condition()
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
        self._last_peers: list[_Seq] = []
        self._drop_cache = False
        self._tokenized = KeptPrompts()
        self._thread = threading.Thread(
            target=self._run, name=f"tokenbelt-batch-{self.name}", daemon=True
        )
        self._warmed = threading.Event()
        self._thread.start()
        self._warmed.wait()

    def _warm_up(self) -> None:
        """One throwaway step at load, as llama.cpp's own server does: the weights are
        paged in and the threads started before the first request, whose first token
        would otherwise pay for both, and whose step time would mislead the thread
        tuner (a cold first try of one count made the other look best for prompts).
        On the loop's thread: llama.cpp's OpenMP team belongs to the thread that calls
        ``llama_decode``, and a second team in the process (this one, started by the
        loading thread) would throttle the loop's barriers for good."""
        lib = self._lib
        ends = (lib.llama_vocab_bos(self._vocab), lib.llama_vocab_eos(self._vocab))
        tokens = [int(t) for t in ends if t >= 0] or [0]
        b = self._batch
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = int(i == len(tokens) - 1)
        b.n_tokens = len(tokens)
        lib.llama_decode(self._ctx.ctx, b)
        lib.llama_memory_clear(self._mem, True)
        b.n_tokens = 0

    @classmethod
    def load(
        cls, model_path: str | Path, *, load_timeout: float | None = None, **options: Any
    ) -> BatchEngine:
        """Load under ``load_timeout`` seconds; raises ``LoadTimeout`` or ``ModelLoadError``."""
        return load_gguf(lambda: cls(model_path, **options), model_path, load_timeout)

    # -- prompts -----------------------------------------------------------------------------

    def tokenize_request(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens for a request (chat template from the GGUF metadata)."""
        return prompt_tokens(self._model, self._formatter, request, self.name)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """Tokenize on the caller's thread and keep the tokens for the loop's admission,
        so the loop (which every running stream waits on) does not template and
        tokenize the same prompt again."""
        check_request(self._lib, self._vocab, self._n_vocab, request, self.name)
        tokens = self.tokenize_request(request)
        self.keep_prompt_tokens(request, tokens)
        return len(tokens)

    def keep_prompt_tokens(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Use ``tokens``, made elsewhere (a worker's parent process, with the same
        vocabulary), as the prompt of ``request`` when it is admitted."""
        check_fits(len(tokens), self.context_length)
        self._tokenized.keep(request, tokens)

    def _prompt_of(self, request: GenerationRequest) -> list[int]:
        kept = self._tokenized.take(request)
        return kept if kept is not None else self.tokenize_request(request)

    # -- requests ----------------------------------------------------------------------------

    def start(
        self, request: GenerationRequest, producer: Producer[str], on_exit: OnExit | None = None
    ) -> None:
        """Hand a request to the loop; never blocks. Raises ``IllegalState`` when full."""
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
            if in_flight and any(s is seq for s in in_flight) and aborts:
                self._flag[0] = b"\x01"
            self._wake = True
            self._cond.notify()
        if waiting:
            try:
                seq.on_exit()
            finally:
                seq.producer.release()

    def _room(self) -> None:
        with self._cond:
            self._wake = True
            self._cond.notify()

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        broken: BaseException | None = None
        try:
            try:
                self._warm_up()
            finally:
                self._warmed.set()
            while self._step_once():
                pass
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            logger.exception("the batch loop of %s failed", self.name)
            broken = exc
        finally:
            with self._cond:
                self._closed = True  # nothing serves the inbox any more: refuse new work
            self._drain(broken)

    def _step_once(self) -> bool:
        """One step: admit, retire, build, decode, sample. False when closed and empty."""
        with self._cond:
            while self._inbox:
                self._active.append(self._inbox.popleft())
            if self._closed and not self._active:
                return False
            drop, self._drop_cache = self._drop_cache, False
        if drop:
            for entry in list(self._cache):
                self._evict(entry)
        for seq in list(self._active):
            if seq.id < 0 and not seq.cancelled:
                self._admit(seq)
        for seq in list(self._active):
            if seq.cancelled or seq.producer.end_reason is not None:
                self._retire(seq, cache=False)
        rows, n_tokens = self._build()
        if n_tokens == 0:
            with self._cond:
                while not self._wake and not self._inbox and not self._closed:
                    self._cond.wait()
                self._wake = False
            return True
        self._decode(rows, n_tokens)
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
        return True

    def _follows(self, seq: _Seq) -> bool:
        """True while another sequence is still computing prompt cells this one can copy:
        the choices of one request (``n``), or the same prompt sent twice, compute their
        shared prompt once. A leader that waits for its reader is not waited for."""
        if not self.cache_entries:
            return False  # the prefix cache is off: every prompt is computed
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
        reuse, source = self._best_prefix(tokens, exclude=seq)
        if reuse > 0 and source >= 0:
            self._lib.llama_memory_seq_cp(self._mem, source, seq.id, 0, reuse)
            seq.n_past = reuse
            p.count_cached(reuse)
            self._prefix_hits += 1
            self._prefix_tokens += reuse

    def _take_id(self) -> int:
        if not self._free_ids:
            self._evict(self._cache[0] if self._cache else None)
        return self._free_ids.pop()

    def _best_prefix(self, tokens: list[int], exclude: _Seq) -> tuple[int, int]:
        """The longest usable cached prefix: (tokens, source sequence id).

        A cache entry that serves moves to the end of ``_cache``, which is kept in order
        of use: the first entry is always the least recently used.
        """
        best, source, hit = 0, -1, None
        if not self.cache_entries:
            return best, source  # the prefix cache is off: every prompt is computed
        limit = len(tokens) - 1  # at least one prompt token must be evaluated for logits
        for entry in self._cache:
            n = min(_common_prefix(entry.tokens, tokens), limit)
            if n > best:
                best, source, hit = n, entry.id, entry
        for seq in self._active:
            if seq is exclude or seq.id < 0 or seq.cancelled:
                continue
            n = min(_common_prefix(seq.tokens[: seq.n_past], tokens), limit)
            if n > best:
                best, source, hit = n, seq.id, None
        if hit is not None:
            self._cache.remove(hit)
            self._cache.append(hit)
        return best, source

    def _sampler(self, s: SamplingParams) -> Any:
        """The sampler chain: bias, penalties, then greedy or top-k/top-p/min-p/temperature."""
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if s.logit_bias:
            biases = (lib.llama_logit_bias * len(s.logit_bias))(*s.logit_bias)
            lib.llama_sampler_chain_add(
                chain, lib.llama_sampler_init_logit_bias(self._n_vocab, len(biases), biases)
            )
        if s.repeat_penalty != 1.0:
            lib.llama_sampler_chain_add(
                chain,
                lib.llama_sampler_init_penalties(
                    self._n_vocab, _PENALTY_LAST_N, s.repeat_penalty, 0.0, 0.0
                ),
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

        def add(seq: _Seq, k: int) -> None:
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
            rows.append((seq, k, last))
            n += k

        active = [s for s in self._active if s.id >= 0 and not s.cancelled]
        decoding = [s for s in active if s.decoding]
        for seq in decoding:
            if seq.producer.has_room():
                add(seq, 1)
            else:
                self._wait_room(seq)
        budget = (self.prefill_chunk if decoding else self.n_batch) - n
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
            for seq in self._in_flight:
                seq.waiting_room = False
            if any(s.cancelled for s in self._in_flight) and (
                all(s.cancelled for s in self._in_flight)
                or any(s.cancelled and s.id in self._in_flight_prefill for s in self._in_flight)
            ):
                self._flag[0] = b"\x01"
        kind = (
            "decode"
            if n_tokens <= self.slots and all(s.decoding for s in self._in_flight)
            else "prefill"
        )
        threads = 0
        if self._tuner is not None:
            threads = self._tuner.choose(kind)
            lib.llama_set_n_threads(self._ctx.ctx, threads, threads)
        started = time.perf_counter()
        ret = lib.llama_decode(self._ctx.ctx, self._batch)
        if self._tuner is not None and ret == 0:
            self._tuner.record(kind, threads, time.perf_counter() - started, n_tokens)
        with self._cond:
            self._in_flight = []
            self._in_flight_prefill = set()
        self._steps += 1
        self._seqs_stepped += len(rows)
        self._tokens_stepped += n_tokens
        if ret != 0:
            self._recover(rows, ret)
            return
        for seq, k, _ in rows:
            seq.n_past += k
        if len(rows) > 1:
            self._note_peers(rows)
        for seq, _, row in rows:
            if row >= 0 and not seq.cancelled:
                self._sample(seq, row)

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
            seq.n_past = int(self._lib.llama_memory_seq_pos_max(self._mem, seq.id)) + 1
        if ret == 2:
            return  # aborted for a stop: the cancelled sequences leave at the next step
        if ret == 1 and self._cache:
            self._evict(self._cache[0])  # no KV room: give the cache's cells back, retry
            return
        error = DecodeError(f"llama.cpp decode failed (code {ret})")
        for seq, _, _ in rows:
            if not seq.cancelled:
                seq.producer.fail(error)
            self._retire(seq, cache=False)

    def _sample(self, seq: _Seq, row: int) -> None:
        lib = self._lib
        p = seq.producer
        if seq.grammar is not None:
            try:
                token = seq.grammar.sample(seq.sampler, self._ctx.ctx, row)
            except DecodeError as exc:  # this sequence fails; the others go on
                p.fail(exc)
                self._retire(seq, cache=False)
                return
        else:
            token = int(lib.llama_sampler_sample(seq.sampler, self._ctx.ctx, row))
        if lib.llama_vocab_is_eog(self._vocab, token):
            self._end(seq, self._tail(seq), EndReason.STOP)
            return
        seq.produced += 1
        p.count_token()
        raw = self._token_bytes(token)
        text, hit = seq.stopper.feed(seq.decoder.decode(raw))
        if hit:
            seq.producer.trace.stop_sequence = seq.stopper.matched
            self._end(seq, self._scored(seq, text, token, raw, row), EndReason.STOP)
        elif seq.produced >= seq.max_new:
            text += self._tail(seq)
            self._end(seq, self._scored(seq, text, token, raw, row), EndReason.LENGTH)
        else:
            seq.tokens.append(token)
            self._put(seq, self._scored(seq, text, token, raw, row))

    def _token_bytes(self, token: int) -> bytes:
        n = self._lib.llama_token_to_piece(self._vocab, token, self._piece, 256, 0, False)
        return self._piece.raw[: max(n, 0)]

    def _scored(self, seq: _Seq, text: str, token: int, raw: bytes, row: int) -> str:
        """``text`` as it goes on the belt: a ``Piece`` with the token's log-probability
        when the request asked for them, else the plain string (the cheap path)."""
        s = seq.request.sampling
        if not s.logprobs:
            return text
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
        return Piece(text, (chosen,))

    def _logprob(self, token: int, logprob: float) -> TokenLogprob:
        raw = self._token_bytes(token)
        return TokenLogprob(raw.decode("utf-8", "replace"), logprob, raw)

    @staticmethod
    def _tail(seq: _Seq) -> str:
        return held_back(seq.stopper, seq.decoder)

    def _put(self, seq: _Seq, text: str) -> bool:
        try:
            seq.producer.put_nowait(text)
        except Cancelled:
            return False
        return True

    def _end(self, seq: _Seq, text: str, reason: EndReason) -> None:
        if self._put(seq, text):
            seq.producer.finish(reason)
        self._retire(seq, cache=reason.is_natural)

    def _retire(self, seq: _Seq, *, cache: bool) -> None:
        """Free (or cache) the sequence's cells, then run its exit hook and release it."""
        if seq in self._active:
            self._active.remove(seq)
        if seq.sampler is not None:
            self._lib.llama_sampler_free(seq.sampler)
            seq.sampler = None
        if seq.grammar is not None:
            seq.grammar.free()
            seq.grammar = None
        if seq.id >= 0:
            if cache and self.cache_entries and 0 < seq.n_past <= self.cache_tokens:
                self._keep(seq.id, seq.tokens[: seq.n_past])
            else:
                self._lib.llama_memory_seq_rm(self._mem, seq.id, -1, -1)
                self._free_ids.append(seq.id)
            seq.id = -1
        if seq.producer.end_reason is None:  # pragma: no cover - every path ends it first
            seq.producer.cancel(EndReason.SHUTDOWN)
        with self._cond:
            self._started -= 1
        try:
            seq.on_exit()
        finally:
            seq.producer.release()

    # -- prefix cache ------------------------------------------------------------------------

    def _keep(self, seq_id: int, tokens: list[int]) -> None:
        self._cache.append(_CacheEntry(seq_id, tokens))  # the most recently used: last
        while len(self._cache) > self.cache_entries or (
            sum(len(e.tokens) for e in self._cache) > self.cache_tokens
        ):
            self._evict(self._cache[0])

    def _evict(self, entry: _CacheEntry | None) -> None:
        if entry is None:  # pragma: no cover - ids are sized for slots + cache entries
            raise IllegalState("no free sequence id")
        self._cache.remove(entry)
        self._lib.llama_memory_seq_rm(self._mem, entry.id, -1, -1)
        self._free_ids.append(entry.id)

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
            running = len(self._active) + len(self._inbox)
        return BatchStatistics(
            slots=self.slots,
            running=running,
            steps=self._steps,
            sequences_stepped=self._seqs_stepped,
            tokens_stepped=self._tokens_stepped,
            aborted_steps=self._aborted,
            prefix_hits=self._prefix_hits,
            prefix_cached_tokens=self._prefix_tokens,
            cache_entries=len(self._cache),
            threads=self.threads,
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

    def close(self) -> None:
        """Stop the loop (running requests end ``shutdown``), then free native memory."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for seq in list(self._active) + list(self._inbox):
                seq.cancelled = True
            self._flag[0] = b"\x01"
            self._cond.notify()
        for seq in list(self._active):
            seq.producer.cancel(EndReason.SHUTDOWN)
        self._thread.join()
        lib = self._lib
        for entry in list(self._cache):
            self._evict(entry)
        lib.llama_set_abort_callback(self._ctx.ctx, lib.ggml_abort_callback(), None)
        lib.llama_batch_free(self._batch)
        self._ctx.close()
        self._model.close()
