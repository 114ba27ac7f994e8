"""A loaded model: its slots, its admission queue, its lifecycle, and request submission."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._defaults import DEFAULT_CAPACITY, DEFAULT_QUEUE_SIZE
from .._errors import IllegalState, ModelLoading, RuntimeClosed
from ..belt import (
    Belt,
    DeadlineTimer,
    Limits,
    Observer,
    Trace,
    check_capacity,
    check_duration,
    new_request_id,
)
from ..engines import Engine, GenerationRequest, Message, sampling_from
from ._scheduler import Scheduler, SchedulerStatistics
from ._session import ChatSession
from ._stream import Reply, Stream
from ._structured import Structure, render_messages, structure, tools_json

logger = logging.getLogger("tokenbelt.runtime")


class ModelState(enum.Enum):
    """Where a model is in its life."""

    #: the engines are being created (weights loading)
    LOADING = "loading"
    #: serving requests
    READY = "ready"
    #: unloaded after the keep-alive with no requests; the next request reloads it
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
    ) -> None:
        self.name = name
        self.capacity = check_capacity(capacity)
        self.queue_size = check_capacity(queue_size, name="queue_size")
        self.limits = limits or Limits()
        self.keep_alive = keep_alive
        #: False for engines given ready-made: closed, they cannot be made again
        self.reloadable = reloadable
        self.info: dict[str, Any] = dict(info or {})
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
        self.loaded_at: float | None = None
        self._load()

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
            self._state = ModelState.READY
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
        return self._context_length or int(self.info.get("context_length", 0))

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

    def statistics(self) -> SchedulerStatistics:
        if self._scheduler is None:
            return SchedulerStatistics(0, 0, 0, self.queue_size, 0)
        return self._scheduler.statistics()

    def _arm_idle(self) -> None:
        if self.keep_alive is None:
            return
        with self._lock:
            if self._state is not ModelState.READY:
                # close() cancels the running requests, and the last one to finish calls
                # us: a timer armed now would outlive the closed model by keep_alive.
                return
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            timer = threading.Timer(self.keep_alive, self._unload_if_idle)
            timer.daemon = True
            timer.name = f"tokenbelt-keepalive-{self.name}"
            self._idle_timer = timer
            timer.start()

    def set_keep_alive(self, seconds: float | None) -> None:
        """Keep the model loaded ``seconds`` after its last request (``None``: for ever).

        Applies from now on: an idle model's timer starts again, and ``0`` unloads an
        idle model before this returns (blocking while its engines close); a busy one
        unloads when its last request is released. The next request loads it again.
        Raises ``IllegalState`` for a model that could not be loaded again.
        """
        if seconds is not None:
            seconds = check_duration("keep_alive", seconds)
        if seconds is not None and not self.reloadable:
            raise IllegalState(
                f"model {self.name} cannot be unloaded: its engines were given ready-made "
                "and could not be made again"
            )
        with self._lock:
            self.keep_alive = seconds
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

    def _unload_if_idle(self) -> None:
        with self._lock:
            sched = self._scheduler
            if self._state is not ModelState.READY or sched is None:
                return
            stats = sched.statistics()
            if stats.running or stats.queued or self._submitting:
                return
            self._set_state(ModelState.IDLE_UNLOADED)
            self._scheduler = None
        logger.info("unloading %s after %s s idle", self.name, self.keep_alive)
        sched.close()
        for engine in sched.engines:
            engine.close()

    def ensure_loaded(self, wait: float | None = None) -> None:
        """Reload the model if it was unloaded for being idle (blocking).

        While another caller reloads it, waits for that load (at most ``wait``
        seconds; ``None``: as long as the load takes), so a burst of requests after
        an idle unload is served, not refused: ``ModelLoading`` only once ``wait`` passed.
        """
        deadline = None if wait is None else time.monotonic() + wait
        with self._lock:
            while self._state is ModelState.LOADING and not self._draining:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._changed.wait(left):
                    raise ModelLoading(f"model {self.name} is still loading")
            if self._draining:
                raise RuntimeClosed(f"model {self.name} is shutting down")
            if self._state is ModelState.READY:
                return
            if self._state is ModelState.CLOSED:
                raise RuntimeClosed(f"model {self.name} is closed")
            self._set_state(ModelState.LOADING)
        try:
            self._load()
        except BaseException:
            with self._lock:
                state: ModelState = self._state
                if state is not ModelState.CLOSED:
                    self._state = ModelState.IDLE_UNLOADED
                self._changed.notify_all()
            raise

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
    ) -> Stream:
        """Queue ``request`` and return its ``Stream`` at once.

        Blocks only while the model is reloaded after an idle unload (by this call or
        another's; waiting at most the request's first-token or total limit, then
        ``ModelLoading``). Raises ``PromptTooLong`` (before queueing), ``QueueFull`` when the
        admission queue is full (the trace ends ``rejected``), ``RuntimeClosed``.
        Deadlines in ``limits`` count from now (enqueue).
        """
        lim = limits or self.limits
        sched = self._hold_loaded(_load_wait(lim))
        try:
            prompt_tokens = sched.engines[0].count_prompt_tokens(request)
            trace = Trace(
                request_id or new_request_id(), model=self.name, observers=self._observers
            )
            trace.prompt_tokens = prompt_tokens
            belt: Belt[str] = Belt(
                capacity if capacity is not None else self.capacity,
                deadlines=lim.deadlines(trace.clock()),
                trace=trace,
                timer=self._timer,
            )
            stream = Stream(belt, on_complete=on_complete, structure=structure)
            sched.submit(request, belt)
        finally:
            with self._lock:
                self._submitting -= 1
        return stream

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
        **sampling: Any,
    ) -> Stream:
        """Stream a reply to chat ``messages`` (or a raw ``prompt``) without a session.

        ``messages`` may be one string: a single user message. ``schema`` (a pydantic
        model class or a JSON schema dict) constrains the reply to that schema; ``tools``
        (OpenAI-shaped functions) and ``tool_choice`` let it call one (``messages`` may
        then hold ``tool_calls`` and ``tool`` turns). The reply's ``parsed`` and
        ``tool_calls`` hold the result.
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
