"""Embeddings beside chat: a second llama.cpp context on the same loaded weights.

The batch engine's loop owns an ``Embedder``. Its context (``embeddings=True``, one
pooling type) is created on the loop's thread at the first embedding request, on the
``llama_model`` the chat context already uses: no second copy of the weights. What it
costs is its own KV cells (``max_tokens`` of them: an input is pooled from one ubatch,
so one ubatch must hold it whole), its compute buffer, and llama.cpp's output buffer,
which holds a row of logits (``n_vocab`` floats) for every token of a ubatch even when
only pooled vectors are read. For the default model (49,152 tokens of vocabulary) at
512 tokens a ubatch, measured as resident memory: 26 MB when the context is made, 225 MB
once a full 512-token ubatch ran (at 2,048 tokens a ubatch it was 61 MB at creation, and
the per-token rows would reach 400 MB: hence the 512 cap).
A chat model also computes its output layer for every embedded token, about a quarter
of the compute of a decoder this size.

Each loop step runs at most one embedding ubatch, after the chat step: inputs of the
running embedding requests packed one sequence id each. Beside chat work (a step with
decode tokens or a prompt chunk), embeddings get a time share: the chat steps' seconds
are their credit and each ubatch spends its own, so they take about half the compute
and the streams keep about half their pace or better; a ubatch then holds the tokens the
credit buys, at most ``prefill_chunk``. With no chat work, a ubatch takes up to
``max_tokens``. An input longer than the budget still goes (alone): it cannot be split.
A request whose belt is full is left out of the step, as a chat sequence is.

Stops: a cancelled request leaves before the next ubatch and is released then; a
ubatch in flight is aborted through llama.cpp's abort hook when every request in it
is cancelled. The inputs of requests that were not cancelled are run again.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..._errors import DecodeError, InvalidArgument, ModelLoadError
from ...belt import EndReason, Producer
from .._embedding import POOLINGS, Embedded, EmbeddingInfo, EmbeddingRequest
from ._binding import flag_abort_callback
from ._gguf import read_header
from ._plan import TimeShare
from ._threads import embed_kind, set_threads

logger = logging.getLogger("tokenbelt.engines.embed")

#: the most tokens one embedding ubatch (hence one input) holds: its KV cells, its
#: compute buffer and its output buffer (a row of logits per token) grow with it
MAX_EMBED_TOKENS = 512
#: the most inputs one ubatch packs (llama.cpp's own limit is 256 sequences)
MAX_EMBED_SEQS = 64

#: llama.cpp's numbers for ``pooling_type``
_POOLING_IDS = {"mean": 1, "cls": 2, "last": 3, "rank": 4}
_POOLING_NAMES = {v: k for k, v in _POOLING_IDS.items()}


def _meta(model: Any, key: str, arch: bool = True) -> str | None:
    """A GGUF metadata value as text (``{arch}.key`` when ``arch``), or None."""
    import llama_cpp

    buf = ctypes.create_string_buffer(128)
    if arch:
        name = _meta(model, "general.architecture", arch=False)
        if name is None:
            return None
        key = f"{name}.{key}"
    if llama_cpp.llama_model_meta_val_str(model.model, key.encode(), buf, 128) < 0:
        return None
    return buf.value.decode("utf-8", "replace")


def _meta_int(model: Any, key: str) -> int | None:
    value = _meta(model, key)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def gguf_pooling(model: Any) -> str | None:
    """The pooling a GGUF's metadata names (``{arch}.pooling_type``), or None when it
    names none. ``model`` is llama-cpp-python's ``_internals.LlamaModel``."""
    number = _meta_int(model, "pooling_type")
    return _POOLING_NAMES.get(number) if number is not None else None


#: the tensors of a classification head that turns a pooled vector into a score
_CLASSIFIER = frozenset({"cls.weight", "cls.output.weight"})


def check_pooling(pooling: str | None, path: str | Path | None = None) -> str | None:
    """Refuse a pooling name llama.cpp does not have, and ``rank`` for a file (``path``)
    with no classification head: llama.cpp would score with whatever hidden value it
    finds there, a number that looks like a score and means nothing (``InvalidArgument``)."""
    if pooling is not None and pooling not in POOLINGS:
        raise InvalidArgument(
            f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}", param="pooling"
        )
    if (
        pooling == "rank"
        and path is not None
        and not _CLASSIFIER.intersection(read_header(Path(path)).tensor_names)
    ):
        raise InvalidArgument(
            f"pooling rank: {Path(path).name} has no classification head (cls.weight or "
            "cls.output.weight), so its scores would mean nothing; it is no reranker",
            param="pooling",
        )
    return pooling


def embedding_info(model: Any, pooling: str | None, context_length: int) -> EmbeddingInfo:
    """The embedding shape of ``model``: its pooling from ``pooling`` (a catalog
    override), else the GGUF, else ``mean`` (a chat model names none); raises
    ``InvalidArgument`` for an unknown pooling name."""
    import llama_cpp

    check_pooling(pooling)
    found = gguf_pooling(model)
    chosen, source = (
        (pooling, "catalog") if pooling else (found, "gguf") if found else ("mean", "default")
    )
    # A vocabulary-only load (a worker's parent) has no sizes: the metadata has them.
    if chosen == "rank":
        dimension = int(llama_cpp.llama_model_n_cls_out(model.model)) or 1
    else:
        dimension = int(llama_cpp.llama_model_n_embd(model.model))
        dimension = dimension or _meta_int(model, "embedding_length") or 0
    trained = int(llama_cpp.llama_model_n_ctx_train(model.model))
    trained = trained or _meta_int(model, "context_length") or context_length
    return EmbeddingInfo(
        dimension=dimension,
        pooling=chosen,
        pooling_source=source,
        max_tokens=max(1, min(context_length, trained, MAX_EMBED_TOKENS)),
        vocab_size=int(llama_cpp.llama_vocab_n_tokens(model.vocab)),
    )


def input_tokens(model: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text as the model embeds it: its own special tokens added (a BOS, or BERT's
    CLS and SEP), the text's own ``<...>`` never read as special tokens."""
    return [list(model.tokenize(t.encode("utf-8"), True, False)) for t in texts]


def pair_tokens(model: Any, query: str, documents: Sequence[str]) -> list[list[int]]:
    """Each (query, document) pair as llama.cpp's server gives it to a rank model:
    ``[BOS] query [EOS] [SEP] document [EOS]``, each special token where the vocabulary
    has and adds it."""
    import llama_cpp

    vocab = model.vocab

    def special(add: Callable[[Any], bool], token: Callable[[Any], int]) -> list[int]:
        t = int(token(vocab))
        return [t] if add(vocab) and t >= 0 else []

    bos = special(llama_cpp.llama_vocab_get_add_bos, llama_cpp.llama_vocab_bos)
    eos = special(llama_cpp.llama_vocab_get_add_eos, llama_cpp.llama_vocab_eos)
    sep = special(llama_cpp.llama_vocab_get_add_sep, llama_cpp.llama_vocab_sep)
    q = list(model.tokenize(query.encode("utf-8"), False, False))
    return [
        bos + q + eos + sep + list(model.tokenize(d.encode("utf-8"), False, False)) + eos
        for d in documents
    ]


def check_inputs(request: EmbeddingRequest, info: EmbeddingInfo) -> int:
    """Refuse an empty request, an empty input or one past ``info.max_tokens``
    (``InvalidArgument`` naming the input); returns the token count."""
    if not request.inputs:
        raise InvalidArgument("input is empty: give at least one text", param="input")
    for i, tokens in enumerate(request.inputs):
        if not tokens:
            raise InvalidArgument(f"input[{i}] has no tokens", param=f"input[{i}]")
        if len(tokens) > info.max_tokens:
            raise InvalidArgument(
                f"input[{i}] has {len(tokens)} tokens but this model embeds at most "
                f"{info.max_tokens}; shorten it or ask for truncation",
                param=f"input[{i}]",
            )
    return request.n_tokens


class EmbedJob:
    """One admitted embedding request: how far it got, and its producer."""

    __slots__ = ("cancelled", "done", "next", "on_exit", "producer", "request", "waiting_room")

    def __init__(
        self, request: EmbeddingRequest, producer: Producer[Any], on_exit: Callable[[], None]
    ) -> None:
        self.request = request
        self.producer = producer
        self.on_exit = on_exit
        self.next = 0  # inputs[:next] are sent to a ubatch (or done)
        self.done = 0  # inputs[:done] are on the belt
        self.cancelled = False
        self.waiting_room = False


class Embedder:
    """The embedding context of one batch engine, driven from its loop's thread.

    ``add``/``cancel`` may be called from any thread (they take ``lock``, the engine's
    condition); ``step``, ``drain`` and ``close`` only from the loop's thread.
    """

    def __init__(
        self,
        model: Any,
        info: EmbeddingInfo,
        *,
        n_threads: int,
        tuner: Any = None,
        lock: threading.Condition,
        wake: Callable[[], None],
        ended: Callable[[], None],
    ) -> None:
        import llama_cpp

        self._lib: Any = llama_cpp
        self._model = model
        self.info = info
        self.n_threads = n_threads
        # The engine's thread tuner (or None for fixed counts): embedding ubatches keep
        # their own costs by size (``embed_kind``), apart from chat's prompt chunks.
        # On a loaded machine a thread count one too many made steps ten times slower.
        self._tuner = tuner
        #: embeddings' time share beside chat steps (``_plan.TimeShare``)
        self._share = TimeShare()
        self._lock = lock
        self._wake = wake
        self._ended = ended  # one request released: the engine's count goes down
        self._jobs: list[EmbedJob] = []
        self._in_flight: list[EmbedJob] = []
        self._ctx: Any = None
        self._ctx_threads = 0  # the thread count the context was last given
        self._batch: Any = None
        self._mem: Any = None
        self._flag = ctypes.create_string_buffer(2)
        self._abort_callback: Any = None
        #: counters since load: ubatches run, inputs and tokens embedded, aborted ubatches
        self.steps = 0
        self.inputs = 0
        self.tokens = 0
        self.aborted = 0

    # -- any thread --------------------------------------------------------------------------

    def add(self, job: EmbedJob) -> None:
        """Take a started request (call with ``lock`` held)."""
        self._jobs.append(job)

    def cancel(self, job: EmbedJob) -> None:
        """Mark ``job`` stopped; abort the ubatch in flight if nothing else is in it."""
        with self._lock:
            job.cancelled = True
            if job in self._in_flight and all(j.cancelled for j in self._in_flight):
                self._flag[0] = b"\x01"
        self._wake()

    @property
    def busy(self) -> bool:
        """Whether some request is admitted and not released (call with ``lock`` held)."""
        return bool(self._jobs)

    @property
    def running(self) -> int:
        """Requests admitted and not released (call with ``lock`` held)."""
        return len(self._jobs)

    # -- the loop's thread -------------------------------------------------------------------

    def _open(self) -> None:
        lib = self._lib
        from llama_cpp import _internals

        n = self.info.max_tokens
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n
        cparams.n_batch = n
        cparams.n_ubatch = n  # one ubatch per step: an input is pooled from one ubatch
        cparams.n_seq_max = MAX_EMBED_SEQS
        cparams.kv_unified = True
        cparams.embeddings = True
        cparams.pooling_type = _POOLING_IDS[self.info.pooling]
        # Off: with flash attention an input's vector changes with what it is packed beside
        # (by up to 1.5e-3 a component), though a short input embeds ~17% sooner here.
        cparams.flash_attn_type = 0
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        try:
            self._ctx = _internals.LlamaContext(model=self._model, params=cparams, verbose=True)
            self._ctx_threads = 0  # as made: the tuner's first choice is set
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not make an embedding context: {exc}") from exc
        self._mem = lib.llama_get_memory(self._ctx.ctx)
        self._batch = lib.llama_batch_init(n, 0, 1)
        self._abort_callback = flag_abort_callback()
        lib.llama_set_abort_callback(
            self._ctx.ctx, self._abort_callback, ctypes.cast(self._flag, ctypes.c_void_p)
        )

    def budget(self, chat_s: float | None, cap: int) -> int:
        """The tokens of the next ubatch (0: none this step): a whole ubatch with no
        chat work in the step (``chat_s`` None), else the time share's (``TimeShare``)."""
        return self._share.budget(chat_s, cap, self.info.max_tokens)

    def step(self, budget: int) -> bool:
        """Retire stopped requests, then run one ubatch of at most ``budget`` tokens;
        False when there was nothing to run (or ``budget`` is 0)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            if job.cancelled or job.producer.end_reason is not None:
                self._retire(job)
        with self._lock:
            jobs = list(self._jobs)
        if not jobs or budget <= 0:
            return False
        if self._ctx is None:
            try:
                self._open()
            except ModelLoadError as exc:
                for job in jobs:
                    job.producer.fail(exc)
                    self._retire(job)
                return True
        limit = max(1, min(budget, self.info.max_tokens))
        parts = self._pack(jobs, limit)
        if not parts:
            return False
        self._run(parts)
        return True

    def _pack(self, jobs: list[EmbedJob], limit: int) -> list[tuple[EmbedJob, int, int]]:
        """Fill the batch: (request, first input, inputs) per request in this ubatch."""
        b = self._batch
        n = 0
        seq = 0
        parts: list[tuple[EmbedJob, int, int]] = []
        for job in jobs:
            if job.next >= len(job.request.inputs):
                continue
            if not job.producer.has_room():
                self._wait_room(job)
                continue
            first = job.next
            inputs = job.request.inputs
            while job.next < len(inputs) and seq < MAX_EMBED_SEQS:
                tokens = inputs[job.next]
                if n and n + len(tokens) > limit:
                    break
                for j, token in enumerate(tokens):
                    i = n + j
                    b.token[i] = token
                    b.pos[i] = j
                    b.n_seq_id[i] = 1
                    b.seq_id[i][0] = seq
                    b.logits[i] = 1
                n += len(tokens)
                seq += 1
                job.next += 1
            if job.next > first:
                parts.append((job, first, job.next - first))
            if seq >= MAX_EMBED_SEQS or (n and job.next < len(inputs)):
                break
        b.n_tokens = n
        return parts

    def _wait_room(self, job: EmbedJob) -> None:
        if job.waiting_room:
            return
        job.waiting_room = job.producer.on_room(self._wake)
        if not job.waiting_room:
            self._wake()

    def _run(self, parts: list[tuple[EmbedJob, int, int]]) -> None:
        import numpy as np

        lib = self._lib
        with self._lock:
            self._flag[0] = b"\x00"
            self._in_flight = [job for job, _, _ in parts]
            for job in self._in_flight:
                job.waiting_room = False
            if all(j.cancelled for j in self._in_flight):
                self._flag[0] = b"\x01"
        lib.llama_memory_clear(self._mem, True)
        threads = 0
        kind = embed_kind(self._batch.n_tokens)
        if self._tuner is not None:
            threads = self._tuner.choose(kind)
            self._ctx_threads = set_threads(lib, self._ctx.ctx, threads, self._ctx_threads)
        started = time.perf_counter()
        ret = lib.llama_decode(self._ctx.ctx, self._batch)
        took = time.perf_counter() - started
        if ret == 0 and self._batch.n_tokens:
            self._share.spent(took, self._batch.n_tokens)
            if self._tuner is not None:
                self._tuner.record(kind, threads, took, self._batch.n_tokens)
        with self._lock:
            self._in_flight = []
        self.steps += 1
        if ret != 0:
            self.aborted += 1
            for job, first, _ in parts:
                job.next = first  # run again at a later step, unless it was stopped
                if ret != 2 and not job.cancelled:
                    job.producer.fail(DecodeError(f"llama.cpp embedding failed (code {ret})"))
            return
        dim = self.info.dimension
        seq = 0
        for job, first, count in parts:
            rows = np.empty((count, dim), dtype=np.float32)
            for k in range(count):
                pointer = lib.llama_get_embeddings_seq(self._ctx.ctx, seq + k)
                if not pointer:
                    raise DecodeError("llama.cpp gave no pooled embedding")
                rows[k] = np.ctypeslib.as_array(pointer, shape=(dim,))
            seq += count
            self.inputs += count
            self.tokens += sum(len(t) for t in job.request.inputs[first : first + count])
            if job.cancelled:
                continue
            if job.request.normalize and self.info.pooling != "rank":
                norms = np.linalg.norm(rows, axis=1, keepdims=True)
                rows /= np.where(norms > 0, norms, 1.0)
            try:
                job.producer.put_nowait(Embedded(first, rows))
            except Exception:  # cancelled meanwhile: it leaves at the next step
                continue
            job.done = first + count
            if job.done == len(job.request.inputs):
                job.producer.finish(EndReason.STOP)
                self._retire(job)

    def _retire(self, job: EmbedJob) -> None:
        with self._lock:
            if job not in self._jobs:
                return
            self._jobs.remove(job)
        if job.producer.end_reason is None:  # pragma: no cover - every path ends it first
            job.producer.cancel(EndReason.SHUTDOWN)
        self._ended()
        try:
            job.on_exit()
        finally:
            job.producer.release()

    def drain(self, error: BaseException | None) -> None:
        """The loop ended: end and release every request left (a close, or a bug)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            if error is not None:
                job.producer.fail(DecodeError(f"the batch loop failed: {error}"))
            else:
                job.producer.cancel(EndReason.SHUTDOWN)
            self._retire(job)

    def stop_all(self) -> None:
        """End every request ``shutdown`` and abort the ubatch in flight (the engine
        closes); the loop releases them at its next step."""
        with self._lock:
            jobs = list(self._jobs)
            for job in jobs:
                job.cancelled = True
            self._flag[0] = b"\x01"
        for job in jobs:
            job.producer.cancel(EndReason.SHUTDOWN)

    def close(self) -> None:
        """Free the context (after the loop ended)."""
        if self._ctx is None:
            return
        lib = self._lib
        lib.llama_set_abort_callback(self._ctx.ctx, lib.ggml_abort_callback(), None)
        lib.llama_batch_free(self._batch)
        self._ctx.close()
        self._ctx = None
