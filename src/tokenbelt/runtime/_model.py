"""A loaded model: its slots, its admission queue, its lifecycle, and request submission."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from .._defaults import DEFAULT_CAPACITY, DEFAULT_QUEUE_SIZE
from .._errors import IllegalState, InvalidArgument, ModelLoading, OverBudget, RuntimeClosed
from ..belt import (
    Belt,
    DeadlineTimer,
    Limits,
    Observer,
    Trace,
    check_capacity,
    check_keep_alive,
    new_request_id,
)
from ..engines import EmbeddingRequest, Embeds, Engine, GenerationRequest, Message, sampling_from
from ._embed import (
    Embeddings,
    EmbeddingStream,
    Ranking,
    TextOrTokens,
    prepare_inputs,
    prepare_pairs,
    ranking,
)
from ._memory import MemoryUse
from ._scheduler import Scheduler, SchedulerStatistics
from ._session import ChatSession
from ._status import ModelStatus
from ._stream import Reply, Stream
from ._structured import Structure, render_messages, structure, tools_json

logger = logging.getLogger("tokenbelt.runtime")


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


_TRANSITIONS = {
    ModelState.LOADING: {ModelState.READY, ModelState.CLOSED},
    ModelState.READY: {ModelState.IDLE_UNLOADED, ModelState.CLOSED},
    ModelState.IDLE_UNLOADED: {ModelState.LOADING, ModelState.CLOSED},
    ModelState.CLOSED: set(),
}


def _load_wait(limits: Limits) -> float | None:
    """How long a request may wait for someone else's reload: its own deadlines."""
    given = [t for t in (limits.first_token, limits.total) if t is not None]
    return min(given) if given else None


def _check_top_n(top_n: int | None) -> None:
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise InvalidArgument(f"top_n must be a positive integer, got {top_n!r}", param="top_n")


class Model:
    """One model with ``slots`` engines and a bounded admission queue.

    Created by ``Runtime.load()``. ``submit`` never blocks on generation: it
    starts the request on a free slot or queues it, and returns a ``Stream``.
    """

    def __init__(
        self,
        name: str,
        engine_factory: Callable[[], Sequence[Engine]],
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        capacity: int = DEFAULT_CAPACITY,
        limits: Limits | None = None,
        keep_alive: float | None = 300.0,
        observers: Sequence[Observer] = (),
        info: dict[str, Any] | None = None,
        timer: DeadlineTimer | None = None,
        reloadable: bool = True,
        load: bool = True,
        pinned: bool = False,
    ) -> None:
        self.name = name
        self.capacity = check_capacity(capacity)
        self.queue_size = check_capacity(queue_size, name="queue_size")
        self.limits = limits or Limits()
        # A pinned model is kept loaded: no idle unload either.
        self.keep_alive = None if pinned else check_keep_alive(keep_alive)
        # The keep-alive of the next idle unload: the latest request's own (Ollama's
        # ``keep_alive``), else ``keep_alive``. Each submit sets it, so one request's
        # value never outlives the next request's.
        self._idle_after: float | None = self.keep_alive
        #: False for engines given ready-made: closed, they cannot be made again
        self.reloadable = reloadable
        #: kept loaded: never evicted for another model, never unloaded for being idle
        #: (its keep-alive is None), and a request's keep-alive of 0 is refused
        self.pinned = pinned
        #: the given dict itself (not a copy): a lazy load fills in what it resolves
        self.info: dict[str, Any] = info if info is not None else {}
        self._engine_factory = engine_factory
        # Deadlines fire from one timer (the runtime's), whether or not anyone reads.
        self._own_timer = timer is None
        self._timer = timer if timer is not None else DeadlineTimer()
        # Not a copy: the runtime's own list, so that ``Runtime.subscribe`` (the HTTP
        # server's metrics, for one) also reaches models registered before it.
        self._observers = observers if isinstance(observers, list) else list(observers)
        self._lock = threading.RLock()
        #: notified when a load ends (callers waiting for a reload wake on it)
        self._changed = threading.Condition(self._lock)
        self._state = ModelState.LOADING
        self._scheduler: Scheduler | None = None
        self._idle_timer: threading.Timer | None = None
        #: submits between their load check and the scheduler: the idle unload waits
        self._submitting = 0
        #: set by ``drain()``: new requests are refused (the model is shutting down)
        self._draining = False
        self._context_length = 0
        self._template_tools = False
        self._tool_format = "tokenbelt"
        self._thinks = False
        self.loaded_at: float | None = None
        #: when a request last started or ended here (the budget unloads the least recent)
        self.last_used = time.monotonic()
        #: why the model is not loaded now (None while it is)
        self.unloaded_because: str | None = None
        #: loads that completed, and unloads to make room for another model
        self.loads = 0
        self.evictions = 0
        # Each load attempt's end, and the error of the latest failed one: callers that
        # waited for a load that failed get its error rather than trying it again.
        self._attempts = 0
        self._load_error: BaseException | None = None
        if load:
            self._load()
        else:
            self._state = ModelState.IDLE_UNLOADED
            self.unloaded_because = "not loaded yet: loads on its first request"

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self._state

    def _set_state(self, new: ModelState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise IllegalState(
                f"model {self.name}: cannot go from {self._state.value} to {new.value}"
            )
        self._state = new

    def _load(self) -> None:
        started = time.monotonic()
        engines = list(self._engine_factory())
        with self._lock:
            if self._state is ModelState.CLOSED:
                for e in engines:
                    e.close()
                raise RuntimeClosed(f"model {self.name} was closed while loading")
            self._scheduler = Scheduler(engines, queue_size=self.queue_size, on_idle=self._arm_idle)
            # Remembered for while the model is unloaded for being idle.
            self._context_length = engines[0].context_length if engines else 0
            self._template_tools = bool(engines and engines[0].template_tools)
            self._tool_format = engines[0].tool_format if engines else "tokenbelt"
            self._thinks = bool(engines and engines[0].reasoning is not None)
            self._state = ModelState.READY
            self.unloaded_because = None
            self.loads += 1
            self._changed.notify_all()
        self.loaded_at = time.monotonic()
        self.info["load_s"] = round(self.loaded_at - started, 3)
        logger.info("loaded %s in %.2f s", self.name, self.loaded_at - started)
        # The keep-alive counts from the load too: a model loaded and never asked
        # anything is unloaded after it, like one whose last request ended.
        self._arm_idle()

    @property
    def engines(self) -> list[Engine]:
        return list(self._scheduler.engines) if self._scheduler else []

    @property
    def context_length(self) -> int:
        """The context window of the loaded engines (unloaded: the one they had)."""
        engines = self.engines
        if engines:
            return engines[0].context_length
        # Not loaded yet: the context it will be loaded with, else the catalog's.
        known = self.info.get("n_ctx_per_seq") or self.info.get("context_length", 0)
        return self._context_length or int(known)

    @property
    def template_tools(self) -> bool:
        """Whether the model's chat template renders tools itself (then a tools request
        passes them to it); otherwise the documented ``<tools>`` system text describes
        them. Kept while the model is unloaded for being idle."""
        return self._template_tools

    @property
    def tool_format(self) -> str:
        """The tool-call family its calls are prompted, generated and parsed in:
        ``hermes``, ``llama3`` or ``mistral`` when its chat template renders tools in
        that family's format, else ``tokenbelt`` (the documented ``<tool_call>``
        format). Kept while the model is unloaded for being idle."""
        return self._tool_format

    @property
    def thinks(self) -> bool:
        """Whether the model's replies have a reasoning phase (its chat template writes
        ``<think>`` markers): they are split into reasoning and answer, and
        ``reasoning_budget``/``reasoning_timeout`` bound it. Kept while unloaded."""
        return self._thinks

    def statistics(self) -> SchedulerStatistics:
        if self._scheduler is None:
            return SchedulerStatistics(0, 0, 0, self.queue_size, 0)
        return self._scheduler.statistics()

    @property
    def idle_keep_alive(self) -> float | None:
        """Seconds the model stays loaded once idle: the latest request's own keep-alive
        if it gave one (``submit(keep_alive=...)``), else ``keep_alive`` (None: for ever)."""
        return self._idle_after

    def _arm_idle(self) -> None:
        self.last_used = time.monotonic()
        seconds = self._idle_after
        if seconds is None:
            return
        with self._lock:
            if self._state is not ModelState.READY:
                # close() cancels the running requests, and the last one to finish calls
                # us: a timer armed now would outlive the closed model by keep_alive.
                return
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            timer = threading.Timer(seconds, lambda: self._idle_expired(timer))
            timer.daemon = True
            timer.name = f"tokenbelt-keepalive-{self.name}"
            self._idle_timer = timer
            timer.start()

    def set_keep_alive(self, seconds: float | None) -> None:
        """Keep the model loaded ``seconds`` after its last request (``None``: for ever):
        the default of every later request that gives no keep-alive of its own.

        Applies from now on: an idle model's timer starts again, and ``0`` unloads an
        idle model before this returns (blocking while its engines close); a busy one
        unloads when its last request is released. The next request loads it again.
        Raises ``IllegalState`` for a model that could not be loaded again.
        """
        self._keep_for(seconds, default=True)

    def keep_loaded_for(self, seconds: float | None) -> None:
        """Once: the model stays loaded ``seconds`` (``None``: for ever) from when it is
        next idle (now, if it is), as a request's own keep-alive; the next request without
        one brings back ``keep_alive``. ``0`` unloads an idle model before this returns.
        Raises as ``set_keep_alive``."""
        self._keep_for(seconds, default=False)

    def _keep_for(self, seconds: float | None, *, default: bool) -> None:
        seconds = check_keep_alive(seconds)
        if self.pinned and not default:
            self._check_pinned_keep_alive(seconds)
            return  # a pinned model stays loaded longer than any request's keep-alive
        if seconds is not None and not self.reloadable:
            raise IllegalState(
                f"model {self.name} cannot be unloaded: its engines were given ready-made "
                "and could not be made again"
            )
        with self._lock:
            if default:
                self.keep_alive = seconds
            self._idle_after = seconds
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            stats = self._scheduler.statistics() if self._scheduler else None
            idle = stats is not None and not stats.running and not stats.queued
        if not idle or seconds is None:
            return
        if seconds == 0:
            self._unload_if_idle()
        else:
            self._arm_idle()

    def _check_pinned_keep_alive(self, seconds: float | None) -> None:
        if seconds == 0:
            raise InvalidArgument(
                f"model {self.name} is pinned (--pin): keep_alive 0 cannot unload it",
                param="keep_alive",
            )

    def _idle_expired(self, timer: threading.Timer) -> None:
        """The keep-alive timer's thread: unload if idle, unless the timer was replaced or
        cancelled meanwhile (a keep-alive changed as it fired). A failure is logged and
        the timer armed again, so the model is never left without one, silently."""
        try:
            self._unload_if_idle(timer=timer)
        except Exception:
            logger.exception("the keep-alive timer of %s failed; armed again", self.name)
            self._arm_idle()

    def _unload_if_idle(
        self, why: str | None = None, *, timer: threading.Timer | None = None
    ) -> bool:
        """Unload now if nothing runs, waits or is being submitted; False if something
        does (or the model is not loaded, or ``timer`` is no longer the keep-alive's).
        Blocks while the engines close."""
        with self._lock:
            if timer is not None and self._idle_timer is not timer:
                return False
            sched = self._scheduler
            if self._state is not ModelState.READY or sched is None:
                return False
            stats = sched.statistics()
            if stats.running or stats.queued or self._submitting:
                return False
            self._set_state(ModelState.IDLE_UNLOADED)
            self._scheduler = None
            if why is None:
                seconds = self._idle_after
                why = "keep_alive 0" if not seconds else f"idle for its keep-alive ({seconds:g} s)"
            self.unloaded_because = why
        logger.info("unloading %s: %s", self.name, why)
        sched.close()
        for engine in sched.engines:
            engine.close()
        return True

    @property
    def load_error(self) -> BaseException | None:
        """The error of the latest load if it failed (None once a load succeeds)."""
        return self._load_error

    def busy(self) -> bool:
        """Whether a request runs, waits or is being submitted (it must not be unloaded)."""
        with self._lock:
            if self._submitting or self._state is ModelState.LOADING:
                return True
            stats = self._scheduler.statistics() if self._scheduler else None
        return stats is not None and bool(stats.running or stats.queued)

    def evict(self, why: str) -> bool:
        """Unload an idle model to make room (``MemoryBudget``); False if it is busy or
        pinned. The next request loads it again."""
        if self.pinned or not self.reloadable:
            return False
        if not self._unload_if_idle(why):
            return False
        self.evictions += 1
        return True

    def status(self) -> ModelStatus:
        """A snapshot of where the model stands (``ModelStatus``)."""
        stats = self.statistics()
        keep = self._idle_after
        loaded_idle = self._state is ModelState.READY and not self.busy()
        expires = (
            max(0.0, self.last_used + keep - time.monotonic())
            if loaded_idle and keep is not None
            else None
        )
        return ModelStatus(
            name=self.name,
            state=self._state.value,
            unloaded_because=self.unloaded_because,
            pinned=self.pinned,
            memory=self.memory(),
            slots=stats.slots or int(self.info.get("slots", 0)),
            running=stats.running,
            queued=stats.queued,
            keep_alive=keep,
            expires_in_s=expires,
            loads=self.loads,
            evictions=self.evictions,
        )

    def memory(self) -> MemoryUse | None:
        """What the loaded model takes (None: not loaded, or nothing is known of it):
        the estimate its load made, with the worker's resident set once it has one."""
        parts = self.info.get("memory_estimate")
        engines = self.engines
        if not isinstance(parts, dict) or not engines:
            return None
        rss = [s.worker.rss_bytes for s in (e.statistics() for e in engines) if s.worker]
        measured = [r for r in rss if r is not None]
        return MemoryUse(**parts, measured=sum(measured) if measured else None)

    def ensure_loaded(self, wait: float | None = None) -> None:
        """Reload the model if it was unloaded for being idle (blocking).

        While another caller reloads it, waits for that load (at most ``wait``
        seconds; ``None``: as long as the load takes), so a burst of requests after
        an idle unload is served, not refused: ``ModelLoading`` only once ``wait`` passed.
        """
        deadline = None if wait is None else time.monotonic() + wait
        with self._lock:
            attempts = self._attempts
            while self._state is ModelState.LOADING and not self._draining:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._changed.wait(left):
                    raise ModelLoading(f"model {self.name} is still loading")
            if self._attempts != attempts and self._load_error is not None:
                # The load this call waited for failed: one load per burst, one reason.
                raise self._load_error
            if self._draining:
                raise RuntimeClosed(f"model {self.name} is shutting down")
            if self._state is ModelState.READY:
                return
            if self._state is ModelState.CLOSED:
                raise RuntimeClosed(f"model {self.name} is closed")
            self._set_state(ModelState.LOADING)
        try:
            self._load()
        except BaseException as exc:
            with self._lock:
                state: ModelState = self._state
                if state is not ModelState.CLOSED:
                    self._state = ModelState.IDLE_UNLOADED
                    self.unloaded_because = (
                        f"refused by the memory budget: {exc}"
                        if isinstance(exc, OverBudget)
                        else f"its last load failed: {exc}"
                    )
                self._attempts += 1
                self._load_error = exc
                self._changed.notify_all()
            raise
        with self._lock:
            self._attempts += 1
            self._load_error = None

    def drain(self) -> None:
        """Refuse new requests (``RuntimeClosed``) and end every queued and running one
        with ``shutdown``; never blocks (``wait_idle`` waits for their release)."""
        with self._lock:
            self._draining = True
            self._changed.notify_all()
            sched = self._scheduler
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        if sched is not None:
            sched.drain()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request runs or waits; False if ``timeout`` passed first."""
        sched = self._scheduler
        return sched is None or sched.wait_idle(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel everything with ``shutdown``, wait for every release, then unload."""
        with self._lock:
            if self._state is ModelState.CLOSED:
                return
            self._state = ModelState.CLOSED
            self._changed.notify_all()
            sched, self._scheduler = self._scheduler, None
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        if sched is not None:
            sched.close(timeout)
            for engine in sched.engines:
                engine.close()
        if self._own_timer:
            self._timer.close()

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        *,
        limits: Limits | None = None,
        capacity: int | None = None,
        request_id: str | None = None,
        on_complete: Callable[[Stream], None] | None = None,
        structure: Structure | None = None,
        keep_alive: float | Literal["default"] | None = "default",
    ) -> Stream:
        """Queue ``request`` and return its ``Stream`` at once.

        ``keep_alive`` is this request's own: the seconds the model stays loaded once
        idle after it (``None``: for ever; ``0``: unloaded then), unless a later request
        brings its own; ``"default"`` is the model's ``keep_alive``.

        Blocks only while the model is reloaded after an idle unload (by this call or
        another's; waiting at most the request's first-token or total limit, then
        ``ModelLoading``). Raises ``PromptTooLong`` (before queueing), ``QueueFull`` when the
        admission queue is full (the trace ends ``rejected``), ``RuntimeClosed``.
        Deadlines in ``limits`` count from now (enqueue). A model whose catalog entry
        says it is an ``embedding`` or ``rerank`` model refuses (``InvalidArgument``).
        """
        kind = self.info.get("kind", "chat")
        if kind != "chat":
            what, use = (
                ("an embedding model", "embeddings")
                if kind == "embedding"
                else (
                    "a reranker",
                    "rerank",
                )
            )
            raise InvalidArgument(
                f"model {self.name} is {what}: it does not generate text (use {use})",
                param="model",
            )
        lim = limits or self.limits
        if keep_alive != "default":
            keep_alive = check_keep_alive(keep_alive)
            if self.pinned:
                self._check_pinned_keep_alive(keep_alive)
                keep_alive = "default"  # it stays loaded: no keep-alive is longer
            if keep_alive is not None and not self.reloadable:
                raise IllegalState(
                    f"model {self.name} cannot be unloaded: its engines were given "
                    "ready-made and could not be made again"
                )
        with self._lock:
            self._idle_after = self.keep_alive if keep_alive == "default" else keep_alive
        sched = self._hold_loaded(_load_wait(lim))
        try:
            prompt_tokens = sched.engines[0].count_prompt_tokens(request)
            belt = self._belt(prompt_tokens, lim, capacity, request_id)
            stream = Stream(belt, on_complete=on_complete, structure=structure)
            sched.submit(request, belt)
        finally:
            with self._lock:
                self._submitting -= 1
        return stream

    def _belt(
        self, prompt_tokens: int, lim: Limits, capacity: int | None, request_id: str | None
    ) -> Belt[Any]:
        trace = Trace(request_id or new_request_id(), model=self.name, observers=self._observers)
        trace.prompt_tokens = prompt_tokens
        # The deadlines count from the enqueue mark itself (the scheduler's own mark is
        # then a no-op): two clock readings let a timeout fire before enqueued + limit.
        now = trace.clock()
        trace.mark_enqueued(now)
        return Belt(
            capacity if capacity is not None else self.capacity,
            deadlines=lim.deadlines(now),
            trace=trace,
            timer=self._timer,
        )

    # -- embeddings and rerank (``_embed.py``) -----------------------------------------------

    def _submit_embedding(
        self,
        make: Callable[[Embeds], EmbeddingRequest],
        kind: str,
        limits: Limits | None,
        request_id: str | None,
    ) -> EmbeddingStream:
        """Tokenize with ``make`` on the loaded engine, then queue as ``submit`` does."""
        lim = limits or self.limits
        sched = self._hold_loaded(_load_wait(lim))
        try:
            engine = sched.engines[0]
            if not isinstance(engine, Embeds):
                raise InvalidArgument(
                    f"model {self.name} does not serve embeddings (its engine, {engine.name}, "
                    "has none)",
                    param="model",
                )
            request = make(engine)
            count = engine.count_prompt_tokens(request)  # type: ignore[arg-type]
            belt = self._belt(count, lim, None, request_id)
            belt.trace.kind = kind
            belt.trace.inputs = len(request.inputs)
            stream = EmbeddingStream(belt, len(request.inputs))
            sched.submit(request, belt)  # type: ignore[arg-type]
        finally:
            with self._lock:
                self._submitting -= 1
        return stream

    def embedding_info(self) -> Any:
        """The model's ``EmbeddingInfo`` (dimension, pooling, input limit), loading it if
        it was unloaded for being idle; ``InvalidArgument`` for a model without."""
        sched = self._hold_loaded(_load_wait(self.limits))
        try:
            engine = sched.engines[0]
            if not isinstance(engine, Embeds):
                raise InvalidArgument(f"model {self.name} does not serve embeddings")
            return engine.embedding_info()
        finally:
            with self._lock:
                self._submitting -= 1
            self._arm_idle()

    def embeddings(
        self,
        texts: Sequence[TextOrTokens] | str,
        *,
        truncate: bool = False,
        normalize: bool = True,
        limits: Limits | None = None,
        request_id: str | None = None,
    ) -> EmbeddingStream:
        """Queue an embedding request and return its ``EmbeddingStream`` at once.

        ``texts`` is one string or a list (of strings, or of token-id lists). Each input
        may hold ``embedding_info().max_tokens`` tokens: longer ones are cut with
        ``truncate``, else ``InvalidArgument`` names the input. The request takes a
        slot and a place in the admission queue like a chat request (``QueueFull``),
        its deadlines count from now (``first_token``: the first vectors), and a stop
        ends it between ubatches. ``normalize``: unit-length vectors.
        """
        items = [texts] if isinstance(texts, str) else texts

        def make(engine: Embeds) -> EmbeddingRequest:
            return prepare_inputs(engine, items, truncate=truncate, normalize=normalize)

        return self._submit_embedding(make, "embed", limits, request_id)

    def embed(self, texts: Sequence[TextOrTokens] | str, **options: Any) -> Embeddings:
        """Blocking ``embeddings(...).read()``: every vector, with usage and trace.

        Raises ``Cancelled`` when the request ended before its last vector (a stop, a
        deadline); a ``KeyboardInterrupt`` while waiting cancels it."""
        return self.embeddings(texts, **options).read()

    async def aembed(self, texts: Sequence[TextOrTokens] | str, **options: Any) -> Embeddings:
        """Async ``embed``: the queueing runs off the event loop, a cancelled task stops
        the request."""
        import asyncio

        stream = await asyncio.to_thread(self.embeddings, texts, **options)
        return await stream.aread()

    def reranking(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = False,
        limits: Limits | None = None,
        request_id: str | None = None,
    ) -> EmbeddingStream:
        """Queue a rerank of ``documents`` against ``query`` (one pair per document) and
        return its stream of score rows. ``InvalidArgument`` for a model whose pooling
        is not ``rank``: an embedding or chat model gives no relevance scores."""

        def make(engine: Embeds) -> EmbeddingRequest:
            return prepare_pairs(engine, query, documents, truncate=truncate)

        return self._submit_embedding(make, "rerank", limits, request_id)

    def rerank(
        self, query: str, documents: Sequence[str], *, top_n: int | None = None, **options: Any
    ) -> Ranking:
        """Blocking rerank: the documents best first (``top_n`` of them), with usage and
        trace; ``Cancelled`` when it ended early."""
        _check_top_n(top_n)
        stream = self.reranking(query, documents, **options)
        done = stream.read()
        return Ranking(
            tuple(ranking(done, documents, top_n)), done.usage, done.trace, done.end_reason
        )

    async def arerank(
        self, query: str, documents: Sequence[str], *, top_n: int | None = None, **options: Any
    ) -> Ranking:
        """Async ``rerank``; a cancelled task stops the request."""
        import asyncio

        _check_top_n(top_n)
        stream = await asyncio.to_thread(self.reranking, query, documents, **options)
        done = await stream.aread()
        return Ranking(
            tuple(ranking(done, documents, top_n)), done.usage, done.trace, done.end_reason
        )

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt tokens ``request`` would have if it were submitted now (its trace's
        ``prompt_tokens``): the chat template and the tools included; nothing is queued.

        Blocks to tokenize, and to reload a model unloaded for being idle (the
        keep-alive counts again from here). Raises as ``submit`` does before queueing
        (``PromptTooLong``, ``InvalidArgument``, ``ModelLoading``, ``RuntimeClosed``).
        """
        sched = self._hold_loaded(_load_wait(self.limits))
        try:
            return sched.engines[0].count_prompt_tokens(request)
        finally:
            with self._lock:
                self._submitting -= 1
                stats = sched.statistics()
                idle = not (stats.running or stats.queued or self._submitting)
            if idle:  # _hold_loaded stopped the idle timer; no request will restart it
                self._arm_idle()

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids as the engine will see them (the chat template and the
        tools included); nothing is queued. Blocks and raises as ``count_prompt_tokens``,
        and ``InvalidArgument`` for an engine that has no vocabulary here (remote)."""
        sched = self._hold_loaded(_load_wait(self.limits))
        try:
            engine = sched.engines[0]
            tokenize = getattr(engine, "tokenize_request", None)
            if tokenize is None:
                raise InvalidArgument(
                    f"return_token_ids is not supported by the {engine.name} engine",
                    param="return_token_ids",
                )
            tokens: list[int] = tokenize(request)
            return tokens
        finally:
            with self._lock:
                self._submitting -= 1
                stats = sched.statistics()
                idle = not (stats.running or stats.queued or self._submitting)
            if idle:
                self._arm_idle()

    def _hold_loaded(self, wait: float | None = None) -> Scheduler:
        """Load the model if needed and keep it loaded until the caller's ``submit`` is done.

        The idle unload (a keep-alive timer, ``keep_alive=0``) may run between a load and
        a submit; a pending submit holds it off, and a model unloaded meanwhile is loaded
        again rather than answered "closed".
        """
        with self._lock:
            # Held from before the load: with keep_alive 0 the load's own idle check
            # would otherwise unload the model before this caller could submit.
            self._submitting += 1
            self.last_used = time.monotonic()
        try:
            while True:
                self.ensure_loaded(wait)
                with self._lock:
                    if self._draining:  # drained while this call was loading it
                        raise RuntimeClosed(f"model {self.name} is shutting down")
                    sched = self._scheduler
                    if sched is None:
                        if self._state is ModelState.CLOSED:
                            raise RuntimeClosed(f"model {self.name} is closed")
                        continue  # unloaded for being idle since ensure_loaded: load again
                    if self._idle_timer is not None:
                        self._idle_timer.cancel()
                        self._idle_timer = None
                    return sched
        except BaseException:
            with self._lock:
                self._submitting -= 1
            raise

    def stream(
        self,
        messages: Sequence[Message] | str | None = None,
        *,
        prompt: str | None = None,
        limits: Limits | None = None,
        capacity: int | None = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        draft: str | None = None,
        **sampling: Any,
    ) -> Stream:
        """Stream a reply to chat ``messages`` (or a raw ``prompt``) without a session.

        ``messages`` may be one string: a single user message. ``schema`` (a pydantic
        model class or a JSON schema dict) constrains the reply to that schema; ``tools``
        (OpenAI-shaped functions) and ``tool_choice`` let it call one (``messages`` may
        then hold ``tool_calls`` and ``tool`` turns). The reply's ``parsed`` and
        ``tool_calls`` hold the result. ``draft`` (``lookup``/``off``; None: the
        runtime's) turns prompt-lookup drafting on or off for this request.
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        shape = structure(schema, tools, tool_choice, self.tool_format)
        tools_text = None
        if shape is not None and shape.tools and messages is not None:
            own = self.template_tools
            messages = render_messages(messages, shape.tools, shape.choice, own)
            tools_text = tools_json(shape.tools, shape.choice, own)
        request = GenerationRequest(
            messages=None if messages is None else tuple(messages),
            prompt=prompt,
            sampling=sampling_from(sampling),
            grammar=shape.grammar if shape else None,
            tools=tools_text,
            draft=draft,
        )
        return self.submit(request, limits=limits, capacity=capacity, structure=shape)

    def complete(self, messages: Sequence[Message] | str | None = None, **kwargs: Any) -> Reply:
        """Blocking ``stream(...).read()``."""
        return self.stream(messages, **kwargs).read()

    def chat(self, system: str | None = None, **defaults: Any) -> ChatSession:
        """A chat session that keeps the conversation; usable with ``with``."""
        return ChatSession(self, system=system, **defaults)

    def achat(self, system: str | None = None, **defaults: Any) -> ChatSession:
        """The same session, meant for ``async with``."""
        return self.chat(system, **defaults)

    def __repr__(self) -> str:
        return f"<Model {self.name} {self._state.value}>"
