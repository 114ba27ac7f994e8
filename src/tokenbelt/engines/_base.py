"""The engine contract: what produces tokens into a belt, as the scheduler sees it.

Every engine has one shape, ``LoopEngine``: ``slots`` requests at once, a non-blocking
``start(request, producer, on_exit)``, ``count_prompt_tokens`` before queueing,
``statistics()`` and ``close()``. An engine sees only the producer side of each
request's belt (``belt.Producer``), never the consumer's. For each started request it
calls ``producer.start()`` when the request is admitted, ``finish``/``fail`` (or sees
the producer's cancel), then ``on_exit()`` and ``producer.release()`` once the request
holds nothing of the engine any more.

- A batch engine (``llama.BatchEngine``) runs one loop of its own that serves every
  admitted request; the worker and remote engines do the same in another process or
  over the network.
- An engine whose work blocks (``generate(request, producer)``, one request at a time:
  the scripted test double, the single-sequence llama.cpp baseline) gets the loop shape
  from ``OnThreads``: each started request runs on a producer thread of its own.

``run_to_end`` turns ``start`` back into a blocking ``generate`` for callers that want
one request on their own thread (``tokenbelt probe``, the benchmarks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .._errors import Cancelled, IllegalState
from ..belt import EndReason, Producer, producing
from ._request import GenerationRequest
from ._statistics import EngineStatistics

#: what an engine calls once a request has ended, before its release (the scheduler
#: frees the request's slot there)
OnExit = Callable[[], None]


class Reasoning(Protocol):
    """A thinking model's reasoning markers, as an engine reports them (the llama
    engines' ``ReasoningFormat``)."""

    @property
    def start(self) -> str:
        """The marker that opens the reasoning phase."""
        ...

    @property
    def end(self) -> str:
        """The marker that ends it."""
        ...


@runtime_checkable
class Tokenizes(Protocol):
    """An engine whose vocabulary is in this process: a prompt's tokens can be made
    here, before it queues (a remote engine's upstream tokenizes instead)."""

    def tokenize_request(self, request: GenerationRequest) -> list[int]:
        """The prompt's tokens, as the engine will compute them (blocking, cheap)."""
        ...

    def remember_prompt_tokens(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Keep ``tokens``, just made by ``tokenize_request``, for ``request``'s count and
        start, so it is not tokenized again."""
        ...


@runtime_checkable
class LoopEngine(Protocol):
    """One loaded model that serves up to ``slots`` requests at once."""

    #: a short name for logs and traces
    name: str
    #: the context window in tokens (of each sequence)
    context_length: int
    #: requests it can run at once: the scheduler gives it no more
    slots: int
    #: whether its chat template renders tools itself (then requests carry ``tools``)
    template_tools: bool
    #: the tool-call family its chat template is written for (``TOOL_FORMATS``)
    tool_format: str

    #: a thinking model's reasoning markers, None for a model whose replies have no
    #: reasoning phase
    @property
    def reasoning(self) -> Reasoning | None: ...

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """Tokenise the request's prompt; raises ``PromptTooLong`` if it cannot fit.

        Cheap compared to generation; lets the runtime reject before queueing.
        """
        ...

    def start(
        self, request: GenerationRequest, producer: Producer[str], on_exit: OnExit | None = None
    ) -> None:
        """Hand a request to the engine; never blocks (safe under the scheduler's lock).

        The engine waits for room before computing each token (backpressure), honours
        the producer's cancel at its next safe point, counts prompt and completion
        tokens on the producer as soon as it knows them, ends the request exactly once
        and then calls ``on_exit()`` and ``producer.release()``. Raises
        ``IllegalState`` when closed or when ``slots`` requests already run.
        """
        ...

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's counters (any thread)."""
        ...

    def close(self) -> None:
        """Free the engine's native memory (or process, or connections). Idempotent."""
        ...


#: the engine contract's name everywhere outside this module
Engine = LoopEngine


def check_can_start(closed: bool, running: int, slots: int, what: str) -> None:
    """The rule every loop engine's ``start`` keeps: raise ``IllegalState`` when the
    engine is closed or when ``slots`` requests (``what``) already run."""
    if closed:
        raise IllegalState("the engine is closed")
    if running >= slots:
        raise IllegalState(f"all {slots} {what} are in use")


class OnThreads:
    """The loop shape for an engine whose ``generate`` blocks: one slot, and each started
    request runs ``generate`` on a producer thread of its own.

    The thread follows the producer protocol that ``Belt.produce`` follows: a natural
    end is recorded as ``generate`` returns it, a ``Cancelled`` ends quietly (the belt
    has the reason), any other error ends the request ``runtime_error``; then
    ``on_exit()`` runs and the release is recorded, even if ``on_exit`` fails.
    """

    name: str
    slots = 1
    #: a thread engine's replies have no reasoning phase unless it says so
    reasoning: Reasoning | None = None

    def __init__(self) -> None:
        self._threads_lock = threading.Lock()
        self._producers: list[threading.Thread] = []

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        """Produce into ``producer`` until the request ends; blocking (see the subclass)."""
        raise NotImplementedError

    def start(
        self, request: GenerationRequest, producer: Producer[str], on_exit: OnExit | None = None
    ) -> None:
        """Run ``generate`` for ``request`` on a new producer thread; never blocks."""
        thread = threading.Thread(
            target=self._produce,
            args=(request, producer, on_exit),
            name=f"tokenbelt-{self.name}-{producer.trace.request_id}",
            daemon=True,
        )
        with self._threads_lock:
            self._producers = [t for t in self._producers if t.is_alive()]
            self._producers.append(thread)
        thread.start()

    def _produce(
        self,
        request: GenerationRequest,
        producer: Producer[str],
        on_exit: OnExit | None,
    ) -> None:
        with producing(producer, on_exit):
            producer.finish(self.generate(request, producer) or EndReason.STOP)

    def statistics(self) -> EngineStatistics:
        with self._threads_lock:
            running = sum(1 for t in self._producers if t.is_alive())
        return EngineStatistics(slots=self.slots, running=running)

    def join_producers(self, timeout: float | None = 30.0) -> None:
        """Wait for the producer threads of started requests to end (not this one)."""
        with self._threads_lock:
            threads = list(self._producers)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout)


def run_to_end(
    start: Callable[..., None], request: GenerationRequest, producer: Producer[str]
) -> EndReason:
    """``generate`` for an engine that only has ``start`` (batch, worker, remote): start
    the request with a ``_Caller`` and block until the engine let go of it. Returns
    ``stop``/``length``; raises the engine's error, or ``Cancelled`` after a stop."""
    caller = _Caller(producer)
    start(request, caller)
    caller.done.wait()
    if caller.error is not None:
        raise caller.error
    if caller.reason is not None:
        return caller.reason
    raise Cancelled(producer.end_reason or EndReason.SHUTDOWN)


class _Caller(Producer[str]):
    """The producer ``generate`` hands to the loop: the caller's ``produce`` records the
    request's end and release, so here they are only remembered and signalled."""

    __slots__ = ("done", "error", "reason")

    def __init__(self, producer: Producer[str]) -> None:
        super().__init__(producer._belt if isinstance(producer, Producer) else producer)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.reason: EndReason | None = None

    @property
    def end_reason(self) -> EndReason | None:
        if self.reason is not None:
            return self.reason
        if self.error is not None:
            return EndReason.RUNTIME_ERROR
        return self._belt.end_reason

    def start(self) -> None:
        pass

    def finish(self, reason: EndReason = EndReason.STOP) -> bool:
        self.reason = reason
        return True

    def fail(self, error: BaseException) -> bool:
        self.error = error
        return True

    def release(self) -> None:
        self.done.set()
