"""A loaded model: its slots, its admission queue, its lifecycle, and the two ways a
request reaches its loaded engine (``_queue``, ``_on_engine``). Its surfaces stand on
those two: the chat surface (``submit``, the prompt's tokens) is ``ChatCalls``
(``_session.py``), the embedding surface ``EmbeddingCalls`` (``_embed.py``), the speech
surface ``TranscriptionCalls`` (``_transcribe.py``); its
keep-alive's rules and timer are a ``KeepAlive`` (``_keepalive.py``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._defaults import DEFAULT_CAPACITY, DEFAULT_QUEUE_SIZE
from .._errors import IllegalState, InvalidArgument, ModelLoading, OverBudget, RuntimeClosed
from ..belt import (
    Belt,
    DeadlineTimer,
    Limits,
    Observer,
    Trace,
    check_capacity,
    new_request_id,
)
from ..engines import Engine
from ._completions import CompletionTally
from ._embed import EmbeddingCalls
from ._infill import InfillCalls, fim_tokens_of
from ._keepalive import KeepAlive, RequestKeepAlive
from ._memory import MemoryUse
from ._scheduler import Scheduler, SchedulerStatistics
from ._session import ChatCalls, ChatSession
from ._status import ModelState, ModelStatus
from ._supersede import Claim, Superseding
from ._transcribe import TranscriptionCalls

logger = logging.getLogger("tokenbelt.runtime")

_T = TypeVar("_T")
_S = TypeVar("_S")


def _load_wait(limits: Limits) -> float | None:
    """How long a request may wait for someone else's reload: its own deadlines."""
    given = [t for t in (limits.first_token, limits.total) if t is not None]
    return min(given) if given else None


class Model(ChatCalls, InfillCalls, EmbeddingCalls, TranscriptionCalls):
    """One model with ``slots`` engines and a bounded admission queue.

    Created by ``Runtime.load()``. ``submit`` (``ChatCalls``) never blocks on
    generation: it starts the request on a free slot or queues it, and returns a
    ``Stream``.
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
        # A pinned model is kept loaded: no idle unload either.
        self._keep = KeepAlive(
            name,
            keep_alive,
            pinned=pinned,
            reloadable=reloadable,
            lock=self._lock,
            ready=lambda: self._state is ModelState.READY,
            expire=lambda timer: self._unload_if_idle(timer=timer),
        )
        #: submits between their load check and the scheduler: the idle unload waits
        self._submitting = 0
        #: set by ``drain()``: new requests are refused (the model is shutting down)
        self._draining = False
        self._context_length = 0
        self._template_tools = False
        self._tool_format = "tokenbelt"
        self._thinks = False
        self._fim_tokens: dict[str, int] | None = None
        #: the latest claim of each supersede key (``claim``)
        self.superseding = Superseding()
        #: its code completions: stale ones, their work, their first tokens (``status``)
        self.completions = CompletionTally()
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
        if not self._state.allows(new):
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
            self._fim_tokens = fim_tokens_of(engines[0]) if engines else {}
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

    @property
    def fim_tokens(self) -> dict[str, int] | None:
        """The FIM tokens of the model's vocabulary (``FIM_TOKENS`` names -> ids; empty
        for an engine that cannot fill in the middle), None until it was first loaded.
        Kept while the model is unloaded for being idle."""
        return self._fim_tokens

    def claim(self, key: str) -> Claim:
        """A new claim on the supersede ``key``: the requests of its previous claim,
        queued or running, end ``superseded`` now (``Superseding.claim``)."""
        if not isinstance(key, str) or not key:
            raise InvalidArgument("supersede is a non-empty string", param="supersede")
        return self.superseding.claim(key)

    def statistics(self) -> SchedulerStatistics:
        if self._scheduler is None:
            return SchedulerStatistics(0, 0, 0, self.queue_size, 0)
        return self._scheduler.statistics()

    @property
    def keep_alive(self) -> float | None:
        """Seconds the model stays loaded after its last request (None: for ever), for
        every request that gives no keep-alive of its own."""
        return self._keep.default

    @property
    def idle_keep_alive(self) -> float | None:
        """Seconds the model stays loaded once idle: the latest request's own keep-alive
        if it gave one (``submit(keep_alive=...)``), else ``keep_alive`` (None: for ever)."""
        return self._keep.next_idle

    def _arm_idle(self) -> None:
        self.last_used = time.monotonic()
        self._keep.arm()

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

    def keep_alive_for_request(self, keep_alive: RequestKeepAlive) -> None:
        """The next request's own keep-alive, as ``submit(keep_alive=...)`` takes it, for a
        request queued another way (``embeddings``): call it just before queueing. Changes
        no default and no running timer; raises as ``submit`` does for it."""
        self._keep.for_request(keep_alive)

    def _keep_for(self, seconds: float | None, *, default: bool) -> None:
        with self._lock:
            now = self._keep.change(seconds, default=default)
            stats = self._scheduler.statistics() if self._scheduler else None
            idle = stats is not None and not stats.running and not stats.queued
        if now is False or now is None or not idle:
            return
        if now == 0:
            self._unload_if_idle()
        else:
            self._arm_idle()

    def _unload_if_idle(
        self, why: str | None = None, *, timer: threading.Timer | None = None
    ) -> bool:
        """Unload now if nothing runs, waits or is being submitted; False if something
        does (or the model is not loaded, or ``timer`` is no longer the keep-alive's).
        Blocks while the engines close."""
        with self._lock:
            if timer is not None and self._keep.timer is not timer:
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
                seconds = self._keep.next_idle
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
        keep = self._keep.next_idle
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
            completions=self.completions.statistics(),
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
            # The requests that waited get the reason; the log keeps it for the operator.
            logger.error("model %s could not be loaded: %s", self.name, exc)
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
            self._keep.cancel()
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
            self._keep.cancel()
        if sched is not None:
            sched.close(timeout)
            for engine in sched.engines:
                engine.close()
        if self._own_timer:
            self._timer.close()

    # -- requests ----------------------------------------------------------------------------

    def _queue(
        self,
        prepare: Callable[[Engine], tuple[Any, int]],
        open_stream: Callable[[Any, Belt[Any]], _S],
        limits: Limits | None,
        capacity: int | None,
        request_id: str | None,
    ) -> _S:
        """Queue the request ``prepare(engine)`` makes (with its prompt token count) on
        the loaded model, and return the caller's stream of it, ``open_stream``'s."""
        lim = limits or self.limits
        sched = self._hold_loaded(_load_wait(lim))
        try:
            request, prompt_tokens = prepare(sched.engines[0])
            belt = self._belt(prompt_tokens, lim, capacity, request_id)
            stream = open_stream(request, belt)
            sched.submit(request, belt)
        finally:
            with self._lock:
                self._submitting -= 1
        return stream

    def _belt(
        self, prompt_tokens: int, lim: Limits, capacity: int | None, request_id: str | None
    ) -> Belt[Any]:
        # The model's own count first: whoever sees a release sees it in ``status()`` too.
        observers = [self.completions.observe, *self._observers]
        trace = Trace(request_id or new_request_id(), model=self.name, observers=observers)
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

    def _on_engine(self, use: Callable[[Engine], _T]) -> _T:
        """``use(engine)`` on the loaded model (loading it if it was unloaded for being
        idle), queueing nothing; then the keep-alive counts again from here."""
        sched = self._hold_loaded(_load_wait(self.limits))
        try:
            return use(sched.engines[0])
        finally:
            with self._lock:
                self._submitting -= 1
                stats = sched.statistics()
                idle = not (stats.running or stats.queued or self._submitting)
            if idle:  # _hold_loaded stopped the idle timer; no request will restart it
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
                    self._keep.cancel()
                    return sched
        except BaseException:
            with self._lock:
                self._submitting -= 1
            raise

    def chat(self, system: str | None = None, **defaults: Any) -> ChatSession:
        """A chat session that keeps the conversation; usable with ``with``."""
        return ChatSession(self, system=system, **defaults)

    def achat(self, system: str | None = None, **defaults: Any) -> ChatSession:
        """The same session, meant for ``async with``."""
        return self.chat(system, **defaults)

    def __repr__(self) -> str:
        return f"<Model {self.name} {self._state.value}>"
