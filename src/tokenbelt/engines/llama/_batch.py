"""The batch engine: many sequences in one llama.cpp context, one decode loop.

One engine thread runs the loop (``_step_once``): take new requests from the inbox, let
``Running`` admit, retire, plan, decode and sample one step, give embeddings their time
share. This class keeps what crosses threads (the inbox, the count of started requests,
wake-ups, cancels, the lifecycle); each other part of the loop's state has one owner, in
a module of its own:

- ``_config.py``: ``LlamaConfig``, every setting, checked once;
- ``_running.py``: the admitted sequences, and what a step does to them;
- ``_plan.py``: which rows go into the next step (decode rows, prompt chunks beside
  running streams by the measured prompt rate, drafts, a thinking deadline's marker),
  and the step costs it is planned by: pure Python, tested without a model;
- ``_inflight.py``: the step in flight, the native abort flag and the stop watch, with
  THE rule of where a stop lands inside a running ``llama_decode``;
- ``_step.py``: llama.cpp's batch buffer, the decode call, thread tuning, step counters;
- ``_sequence.py``: one request's tokens and what a sampled token becomes (phases, stop
  strings, ``max_tokens``);
- ``_prefix.py``: sequence ids, their cells, and the prefix cache (in memory, and on
  disk through ``_persist.py``);
- ``_prompts.py``: the model's template and reasoning markers, prompts tokenized before
  they queue;
- ``_sampling.py``: sampler chains, sampling a row, a token's bytes and log-probabilities;
- ``_embed.py``: embeddings, a second context on the same weights, between steps.

Where a stop lands, per sequence: a cancelled sequence leaves before the next step (its
KV cells are freed and its release is recorded then, within one batched step of the
stop); a running step is aborted as ``_inflight.py`` says. llama.cpp then drops that
step's cells, and every surviving sequence goes on from where its KV ends
(``llama_memory_seq_pos_max``): a stop never ends, corrupts or errors another stream, and
costs it at most one step redone.

The KV cache is one unified buffer of ``slots * n_ctx`` cells: each sequence may hold up
to ``n_ctx`` tokens (prompt, reply and a draft), and shared prefixes take their cells
once. Prefix-cache entries are not cells: each is a copy in the process's memory.

Drafting (``draft="lookup"``, or a request's own ``draft``): a decoding sequence may add
a draft of up to ``draft_tokens`` tokens, taken from its own earlier text, to its pending
token in a step; the rows are sampled in order and the draft is accepted up to the first
sample that differs (``_verify``), the cells of the rest are removed at once. It is
measured per request and turns itself off where it does not pay (``_draft.py``). A
draft's cells never outlive its step: ``n_past`` counts only verified tokens, an aborted
step and a retired sequence drop the rest. Sequences with a grammar or a reasoning phase
never draft (their samplers' state and the forced end marker are tied to one token per
step).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ...belt import DeadlineTimer, EndReason, Producer
from .._base import OnExit, check_can_start, run_to_end
from .._embedding import EmbeddingInfo, EmbeddingRequest
from .._infill import Infill, InfillPrompt
from .._request import GenerationRequest
from .._statistics import BatchStatistics
from ._binding import flag_abort_callback, quiet_native_logs
from ._config import LlamaConfig, cache_tokens_for
from ._embed import (
    Embedder,
    EmbedJob,
    check_inputs,
    check_pooling,
    embedding_info,
    input_tokens,
    pair_tokens,
)
from ._gguf import read_header
from ._inflight import StepInFlight
from ._loading import check_gguf_file, load_gguf, open_context
from ._persist import PrefixStore, model_key
from ._plan import StepCosts, StepPlan
from ._prefix import MAX_SEQUENCES, PrefixCache
from ._prompts import Prompts
from ._running import Running
from ._sampling import Vocabulary
from ._sequence import Sequence
from ._step import NativeStep
from ._threads import (
    ThreadTuner,
    default_threads,
    lower_this_thread,
    system_load,
    thread_candidates,
    usable_cores,
)

logger = logging.getLogger("tokenbelt.engines.batch")


class BatchEngine:
    """One llama.cpp context serving up to ``slots`` requests at once, batched.

    ``BatchEngine(path, config)`` loads the model with a ``LlamaConfig`` (its fields may
    also be given as keywords, over ``config`` or the defaults); it blocks until the
    weights are loaded and one warm-up step has run.

    ``start(request, producer, on_exit)`` never blocks: the engine thread admits the
    request at its next step. For each request the engine calls ``producer.start()``
    when it is admitted, ``finish``/``fail`` (or sees the producer's cancel), then
    ``on_exit()`` and ``producer.release()`` once its KV cells are free or cached.
    At most ``slots`` requests may be started and not yet released.

    With an f16 KV cache a stream's greedy text depends on what shares its steps:
    llama.cpp's CPU kernels pick their path by the step's shape (one row over 512 or more
    cells splits attention across the decode threads; 64 rows or more take a tiled
    kernel; without flash attention one row's products differ from many rows'). Both
    paths need f16 or f32 keys: with ``kv_type="q8_0"`` every row is computed alike, and
    greedy text is the same alone, batched, drafted or from the prefix cache.

    Threads: the loop (``tokenbelt-batch-<name>``) owns every sequence, the context and
    the caches; the stop watch (``_inflight.py``) and the thinking deadlines' timer only
    abort a step; callers' threads only hand work in (``start``, a cancel,
    ``between_steps``, ``clear_prefix_cache``) under ``_cond``.
    """

    def __init__(
        self, model_path: str | Path, config: LlamaConfig | None = None, **options: Any
    ) -> None:
        import llama_cpp

        if options or config is None:
            config = LlamaConfig.of(config, **options)
        #: every setting this engine was made with
        self.config = config
        path = check_gguf_file(model_path)
        check_pooling(config.pooling, path)
        quiet_native_logs()
        self._lib: Any = llama_cpp
        self.model_path = path
        self.name = config.name or path.stem
        self.slots = config.slots  # llama.cpp's sequence limit
        #: sequence ids: the running requests' and a spare one (``PrefixCache.spare``)
        self.n_seq_max = min(self.slots + 1, MAX_SEQUENCES)
        self.context_length = config.n_ctx
        self.n_batch = max(config.n_batch, self.slots + 1)
        threads, threads_batch = default_threads()
        self.n_threads = config.n_threads or threads
        self.n_threads_batch = config.n_threads_batch or threads_batch
        # Thread counts given by the caller are kept; the default adapts to the machine.
        self._tuner = (
            ThreadTuner(thread_candidates(usable_cores(), system_load()))
            if config.n_threads is None and config.n_threads_batch is None
            else None
        )
        self._model, self._ctx = open_context(
            self._lib,
            path,
            config,
            n_cells=self.slots * config.n_ctx,
            n_batch=self.n_batch,
            n_seq_max=self.n_seq_max,
            threads=(self.n_threads, self.n_threads_batch),
        )
        self._read_model()
        self._init_loop_state()
        # Embeddings: a second context on these weights, made at the first request.
        self._embedder = Embedder(
            self._model,
            embedding_info(self._model, config.pooling, config.n_ctx),
            n_threads=self.n_threads_batch,
            tuner=self._tuner,
            lock=self._cond,
            wake=self._room,
            ended=self._released,
        )
        self._thread = threading.Thread(
            target=self._run, name=f"tokenbelt-batch-{self.name}", daemon=True
        )
        self._warmed = threading.Event()
        self._thread.start()
        self._inflight.start()
        self._warmed.wait()

    def _read_model(self) -> None:
        """What the loop reads of the loaded model: vocabulary, template, tool format,
        reasoning markers; the batch, the prefix cache, and the native abort hook."""
        llama_cpp, config = self._lib, self.config
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self._model.model))
        self._vocab = self._model.vocab
        self._words = Vocabulary(llama_cpp, self._ctx.ctx, self._vocab, self.context_length)
        self._n_vocab = self._words.n_vocab
        #: the context's KV memory, as llama.cpp sees it (the cells are ``PrefixCache``'s;
        #: tests read llama.cpp's own view of them through this)
        self._mem = llama_cpp.llama_get_memory(self._ctx.ctx)
        self._prompts = Prompts(
            llama_cpp,
            self._model,
            name=self.name,
            context_length=self.context_length,
            reasoning=config.reasoning,
        )
        self.template_tools = self._prompts.template_tools
        self.tool_format = self._prompts.tool_format
        #: a thinking model's reasoning markers (None: it has none, or ``reasoning=False``)
        self.reasoning = self._prompts.reasoning
        #: the FIM tokens its vocabulary has (``FillsMiddle``)
        self.fim_tokens = self._prompts.fim_tokens
        store: PrefixStore | None = None
        if config.prefix_cache_dir is not None and config.prefix_cache_disk and config.prefix_cache:
            try:
                key = model_key(llama_cpp, self._model.model, self.model_path, config.kv_type)
            except OSError as exc:
                logger.warning("%s: the prefix cache stays in memory: %s", self.name, exc)
            else:
                store = PrefixStore(config.prefix_cache_dir, config.prefix_cache_disk, key)
        self._cells = PrefixCache(
            llama_cpp,
            self._ctx.ctx,
            n_seq_max=self.n_seq_max,
            entries=config.cache_entries,
            tokens=cache_tokens_for(
                config.cache_tokens, read_header(self.model_path).kv_cell_bytes(config.kv_type)
            )
            if config.cache_tokens is None
            else config.cache_tokens,
            shift_least=config.cache_reuse,
            most_gap=max(1, min(config.prefill_chunk, self.n_batch - self.slots)),
            context_length=self.context_length,
            n_vocab=self._n_vocab,
            store=store,
            name=self.name,
        )
        # The abort hook reads the step's flag natively; the loop clears it before each step.
        self._inflight = StepInFlight(self.name, config.stop_abort_after)
        self._abort_callback = flag_abort_callback()
        flag = ctypes.cast(self._inflight.flag, ctypes.c_void_p)
        llama_cpp.llama_set_abort_callback(self._ctx.ctx, self._abort_callback, flag)

    def _init_loop_state(self) -> None:
        """The loop's locks, queues, sequences and counters, before its thread starts."""
        config = self.config
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        #: work for the loop to run between two steps (``between_steps``)
        self._between: list[Callable[[], None]] = []
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._costs = StepCosts()
        self._step = NativeStep(
            self._lib,
            self._ctx.ctx,
            n_batch=self.n_batch,
            slots=self.slots,
            tuner=self._tuner,
            costs=self._costs,
        )
        self._plan = StepPlan(
            n_batch=self.n_batch,
            slots=self.slots,
            prefill_chunk=max(1, min(config.prefill_chunk, self.n_batch - self.slots)),
            prefill_gap=config.prefill_gap,
            draft_tokens=config.draft_tokens,
            costs=self._costs,
        )
        # Thinking deadlines fire here whether or not the loop is in a step, as a
        # runtime's request deadlines do (its thread starts with the engine).
        self._deadlines = DeadlineTimer(name=f"tokenbelt-thinking-{self.name}")
        self._running = Running(
            self._lib,
            name=self.name,
            config=config,
            prompts=self._prompts,
            words=self._words,
            cells=self._cells,
            plan=self._plan,
            step=self._step,
            inflight=self._inflight,
            deadlines=self._deadlines,
            released=self._released,
            wake=self._room,
        )
        self._started = 0
        self._wake = False
        self._closed = False
        self._loop_failed = False
        self._drop_cache = False

    def _warm_up(self) -> None:
        """One step at load, as llama.cpp's own server does: the weights are paged in
        and the threads started before the first request, whose first token would
        otherwise pay for both, and whose step time would mislead the thread tuner (a
        cold first try of one count made the other look best for prompts). The step
        computes the chat template's head (``Prompts.template_head``) and keeps it as a
        prefix-cache entry, so that even the first chat request after a load computes
        only its own part (the default model: 28 of a short question's 44 tokens; its
        first token 40 ms instead of 97 here); without a template or a cache, it
        computes the start and end tokens and keeps nothing.
        On the loop's thread: llama.cpp's OpenMP team belongs to the thread that calls
        ``llama_decode``, and a second team in the process (this one, started by the
        loading thread) would throttle the loop's barriers for good."""
        lib, cells = self._lib, self._cells
        limit = min(self.n_batch, cells.max_tokens, self.context_length - 1)
        head = self._prompts.template_head(limit) if cells.on else []
        if any(entry.tokens[: len(head)] == head for entry in cells.entries):
            head = []  # a restored entry starts with it
        ends = (lib.llama_vocab_bos(self._vocab), lib.llama_vocab_eos(self._vocab))
        tokens = head or [int(t) for t in ends if t >= 0] or [0]
        seq_id = cells.take_id()
        if self._step.warm(tokens, seq_id) and head:
            cells.keep(seq_id, tokens)
            cells.head = tokens  # computed again at each load: never saved
        cells.free(seq_id)

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        config: LlamaConfig | None = None,
        *,
        load_timeout: float | None = None,
        **options: Any,
    ) -> BatchEngine:
        """Load under ``load_timeout`` seconds; raises ``LoadTimeout`` or ``ModelLoadError``."""
        return load_gguf(lambda: cls(model_path, config, **options), model_path, load_timeout)

    # -- prompts -----------------------------------------------------------------------------

    def tokenize_request(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens for a request (chat template from the GGUF metadata)."""
        return self._prompts.tokenize(request)

    def infill_prompt(self, infill: Infill, max_tokens: int) -> InfillPrompt:
        """The fill-in-the-middle prompt of ``infill`` (``FillsMiddle``)."""
        return self._prompts.infill(infill, max_tokens)

    def count_prompt_tokens(self, request: GenerationRequest | EmbeddingRequest) -> int:
        """Tokenize on the caller's thread and keep the tokens for the loop's admission,
        so the loop (which every running stream waits on) does not template and
        tokenize the same prompt again. An embedding request's inputs are checked."""
        if isinstance(request, EmbeddingRequest):
            return check_inputs(request, self._embedder.info)
        return self._prompts.count(request)

    def remember_prompt_tokens(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Keep ``tokens``, just made by ``tokenize_request``, for ``request``'s count and
        admission (a chat fitted to its window is not tokenized again)."""
        self._prompts.remember(request, tokens)

    def keep_prompt_tokens(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Use ``tokens``, made elsewhere (a worker's parent process, with the same
        vocabulary), as the prompt of ``request`` when it is admitted."""
        self._prompts.keep(request, tokens)

    # -- embeddings (``_embed.py``) -----------------------------------------------------------

    def embedding_info(self) -> EmbeddingInfo:
        return self._embedder.info

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        return input_tokens(self._model, texts)

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[list[int]]:
        return pair_tokens(self._model, query, documents)

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
        seq = Sequence(request, producer, on_exit or (lambda: None))
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

    def _on_cancel(self, seq: Sequence) -> None:
        """On the cancelling thread: mark the sequence, let the step in flight apply the
        stop rule (``StepInFlight.stop``), and wake the loop so the sequence is
        released before the next step."""
        with self._cond:
            seq.cancelled = True
            waiting = seq in self._inbox
            if waiting:
                # Not admitted yet: it holds no KV cells, so it can go now, without
                # waiting for the step in flight to end.
                self._inbox.remove(seq)
                self._started -= 1
            self._inflight.stop(seq)
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
        """Each step's sampling and progress counts, and each admission's counts, run
        inside a ``wrap()`` of their own (set before the first request; ``Running``)."""
        self._running.sampling = wrap

    def _room(self) -> None:
        with self._cond:
            self._wake = True
            self._cond.notify()

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        broken: BaseException | None = None
        try:
            try:
                # Before the warm-up's first step starts llama.cpp's threads: they inherit it.
                lower_this_thread(self.config.decode_nice)
                self._cells.restore()
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
            self._inflight.close()
            self._drain(broken)

    def _step_once(self) -> bool:
        """One step: admit, retire, plan, decode, sample. False when closed and empty."""
        with self._cond:
            while self._inbox:
                self._running.active.append(self._inbox.popleft())
            if self._closed and not self._running.active and not self._embedder.busy:
                return False
            drop, self._drop_cache = self._drop_cache, False
            between, self._between = self._between, []
        for callback in between:
            callback()
        if drop:
            self._cells.clear()
        started = time.perf_counter()
        n_tokens = self._running.step()
        # At most one embedding ubatch per step, on a time share beside chat work.
        chat_s = time.perf_counter() - started if n_tokens else None
        budget = self._embedder.budget(chat_s, self._plan.prefill_chunk)
        if self._embedder.step(budget) or n_tokens:
            return True
        with self._cond:
            while not self._wake and not self._inbox and not self._closed:
                self._cond.wait()
            self._wake = False
        return True

    def prompt_chunk(self) -> int:
        """The most tokens a step carries while sequences decode (``StepPlan``)."""
        return self._plan.prompt_chunk()

    def _released(self) -> None:
        with self._cond:
            self._started -= 1

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
        flag = self._inflight.flag

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
            running = len(self._running.active) + len(self._inbox) + self._embedder.running
        cells = self._cells
        return BatchStatistics(
            slots=self.slots,
            running=running,
            steps=self._step.steps,
            sequences_stepped=self._step.sequences,
            tokens_stepped=self._step.tokens,
            aborted_steps=self._step.aborted,
            stop_aborted_steps=self._inflight.escalated,
            prefix_hits=cells.hits,
            prefix_cached_tokens=cells.hit_tokens,
            cache_entries=len(cells.entries),
            threads=self.threads,
            restored_entries=cells.restored[0],
            restored_tokens=cells.restored[1],
            saved_entries=cells.saved[0],
            saved_bytes=cells.saved[1],
            step_costs=dict(self._costs.steps),
            **self._running.draft_counts(),
        )

    def _drain(self, error: BaseException | None) -> None:
        """The loop ended: end and release whatever is left (a bug or a close)."""
        with self._cond:
            left = list(self._running.active) + list(self._inbox)
            self._running.active.clear()
            self._inbox.clear()
        self._running.drain(left, error)
        self._embedder.drain(error)

    def close(self) -> None:
        """Stop the loop (running requests end ``shutdown``), save the prefix cache (with
        a ``prefix_cache_dir``: blocks on that write, bounded by ``prefix_cache_disk``),
        then free native memory."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for seq in list(self._running.active) + list(self._inbox):
                seq.cancelled = True
            self._inflight.abort()
            self._cond.notify()
        self._embedder.stop_all()
        for seq in list(self._running.active):
            seq.producer.cancel(EndReason.SHUTDOWN)
        self._thread.join()
        self._inflight.close()
        self._embedder.close()
        self._deadlines.close()
        lib = self._lib
        if not self._loop_failed:
            self._cells.save()
        self._cells.clear()
        lib.llama_set_abort_callback(self._ctx.ctx, lib.ggml_abort_callback(), None)
        self._step.free()
        self._ctx.close()
        self._model.close()
