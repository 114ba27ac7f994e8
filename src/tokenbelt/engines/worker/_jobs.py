"""One request as the worker's parent tracks it: its producer, its credits, its stop,
and what the worker's messages about it do to its belt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._errors import Cancelled, DecodeError
from ...belt import EndReason, Producer
from .._request import GenerationRequest
from . import _messages as msg
from ._process import Process


def _count_tokens(producer: Producer[Any], tokens: int) -> None:
    """The tokens a worker's message carried, counted on the parent's belt."""
    for _ in range(tokens):
        producer.count_token()


class Job:
    """A request started on a ``WorkerEngine``: sent to a worker, or waiting for one."""

    __slots__ = (
        "admitted",
        "capacity",
        "granted",
        "on_exit",
        "producer",
        "received",
        "request",
        "rid",
        "stop_by",
        "worker",
    )

    def __init__(
        self,
        rid: int,
        request: GenerationRequest,
        producer: Producer[Any],
        on_exit: Callable[[], None],
    ) -> None:
        self.rid = rid
        self.request = request
        self.producer = producer
        self.on_exit = on_exit
        self.capacity = producer.capacity
        self.granted = self.capacity  # items the worker may send in all
        self.received = 0
        #: when a stop not yet honoured kills the worker (monotonic), once stopped
        self.stop_by: float | None = None
        #: the worker process it was sent to (None while it waits for one)
        self.worker: Process | None = None
        #: the worker's engine admitted it (before that, a crash sends it to the next one)
        self.admitted = False

    def apply(self, message: msg.ToParent) -> bool:
        """Carry a worker's message about this request to its producer; True when it
        put an item on the belt (the engine then grants the room the reader made). A
        ``Release`` is counted here and left to the engine to release."""
        p = self.producer
        match message:
            case msg.Item(_, item, tokens):
                _count_tokens(p, tokens)
                try:
                    p.put_nowait(item)
                except Cancelled:
                    return False
                self.received += 1
                return True
            case msg.Admit():
                self.admitted = True
                p.start()
            case msg.Prompt(_, n):
                p.count_prompt(n)
            case msg.Cached(_, n):
                p.count_cached(n)
            case msg.Read(_, n):
                p.count_read(n)
            case msg.Reasoning(_, at, _, _, True):
                p.trace.mark_answer(at)
            case msg.Reasoning(_, at, tokens, ended_by):
                p.trace.mark_reasoning(tokens, ended_by, at)
            case msg.Finish(_, reason, tokens, stop_sequence):
                _count_tokens(p, tokens)
                if stop_sequence is not None:
                    p.trace.stop_sequence = stop_sequence
                p.finish(reason)
            case msg.Fail(_, error, tokens):
                _count_tokens(p, tokens)
                p.fail(DecodeError(error))
            case msg.Cancel(_, reason):
                p.cancel(reason)
            case msg.Release(_, batched_with, _, drafted, accepted, tokens, decision):
                _count_tokens(p, tokens)
                p.trace.batched_with.update(batched_with)
                if decision is not None:
                    p.count_draft(drafted, accepted, decision)
        return False

    def unsent(self) -> None:
        """Back to waiting for a worker: its worker died before admitting it."""
        self.worker = None
        self.granted = self.capacity
        self.received = 0

    def credit_due(self) -> tuple[int, bool]:
        """The room the reader made since the last grant, and whether the worker is out
        of credits (it sent every item it was granted)."""
        consumed = self.producer.statistics().consumed
        return consumed + self.capacity - self.granted, self.received >= self.granted

    def let_go(self) -> None:
        """The engine is done with the request: its exit hook, then its release."""
        if self.producer.end_reason is None:  # pragma: no cover - every path ends it first
            self.producer.cancel(EndReason.SHUTDOWN)
        try:
            self.on_exit()
        finally:
            self.producer.release()

    def end(self, error: BaseException) -> None:
        """End with ``error`` (a no-op after a stop: that reason stays), then let go."""
        self.producer.fail(error)
        self.let_go()

    def record_kill(self, w: Process, cause: str) -> None:
        """Record in the trace that ``w`` is killed for this request's stop."""
        trace = self.producer.trace
        stopped = trace.cancel_requested
        trace.worker = {
            "pid": w.pid,
            "killed": cause,
            "killed_after_stop_ms": (
                None if stopped is None else round((trace.clock() - stopped) * 1000, 3)
            ),
        }
