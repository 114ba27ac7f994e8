"""The per-request timeline: timestamps, counters, one end reason, observers.

Timestamps are ``time.monotonic()`` seconds. ``to_dict()`` turns them into
milliseconds relative to ``enqueued`` plus one wall-clock anchor, so a trace
serialises to JSON without losing the order of events.
"""

from __future__ import annotations

import array
import collections
import heapq
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _invariants
from ._reasons import EndReason

logger = logging.getLogger("tokenbelt.trace")

#: A release later than this after a cancel is an alert (``release_lag`` event).
DEFAULT_RELEASE_LAG_THRESHOLD = 1.0

TIMESTAMPS = ("enqueued", "admitted", "first_token", "last_token", "cancel_requested", "released")


@dataclass(frozen=True)
class TraceEvent:
    """One lifecycle event of one request.

    ``kind`` is one of ``enqueued``, ``admitted``, ``first_token``,
    ``cancel_requested``, ``ended``, ``released`` and ``release_lag`` (a warning:
    the engine kept the request long after it was asked to stop).
    """

    kind: str
    trace: Trace
    at: float


Observer = Callable[[TraceEvent], None]


def new_request_id() -> str:
    """A short random request id, safe in URLs and headers."""
    return "req_" + secrets.token_hex(8)


class Trace:
    """The timeline of one request.

    Marks are set once: the first call wins, later calls are ignored, so the
    producer thread and the consumer may both mark without coordinating.

    Ordering: a fact (a timestamp, the end reason) is recorded under ``_lock``
    together with its event; events are delivered by ``flush()`` in the order they
    were recorded, by one thread at a time, so every observer sees the same
    sequence and never a later fact before an earlier one. Observers run on the
    delivering thread (the one that caused the event, or one that was delivering
    this request's earlier events); they must be quick and thread-safe. An
    observer that raises is logged and skipped.
    """

    def __init__(
        self,
        request_id: str | None = None,
        *,
        model: str | None = None,
        observers: list[Observer] | tuple[Observer, ...] = (),
        release_lag_threshold: float = DEFAULT_RELEASE_LAG_THRESHOLD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.request_id = request_id or new_request_id()
        self.model = model
        self.clock = clock
        self.release_lag_threshold = release_lag_threshold
        self.enqueued: float | None = None
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.cancel_requested: float | None = None
        self.released: float | None = None
        self.end_reason: EndReason | None = None
        self.error: str | None = None
        #: the stop string that ended the request (set by the engine), if one did
        self.stop_sequence: str | None = None
        self.prompt_tokens = 0
        #: a chat's oldest messages left out of the prompt so that it fits the context
        #: window (Ollama's chat, the Responses API's ``truncation: "auto"``)
        self.dropped_messages = 0
        #: prompt tokens whose KV cells came from the prefix cache instead of compute
        self.cached_tokens = 0
        #: prompt tokens in the KV cache so far (cached or computed): how far a long
        #: prompt's prefill has come while no token is out yet
        self.prompt_read = 0
        self.completion_tokens = 0
        #: tokens drafted (prompt lookup) and verified in a step, and those of them the
        #: sampler accepted: each accepted one is a token that cost no step of its own
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        #: why drafting was on or off for the request (``DRAFT_DECISIONS``; None: an
        #: engine that does not draft)
        self.draft_decision: str | None = None
        self.buffer_peak = 0
        self.release_lagged = False
        #: ids of other requests that shared a batched decode step with this one
        self.batched_with: set[str] = set()
        #: seconds between consecutive tokens as they were produced (4 bytes each)
        self.token_gaps: array.array[float] = array.array("f")
        #: a remote engine's upstream: its URL, its request id and (from a tokenbelt
        #: upstream) its own trace, whose ``released`` says when its slot was free
        self.upstream: dict[str, Any] | None = None
        #: the engine worker process that served it: its ``pid``, and ``killed`` (why
        #: the runtime killed it) when a stop it did not honour in time ended it
        self.worker: dict[str, Any] | None = None
        #: a thinking model's reasoning phase (set by the engine): when it started and
        #: ended, its tokens so far, and what ended it (``marker``: the model wrote its
        #: end marker; ``budget``: ``reasoning_budget`` was spent; ``deadline``:
        #: ``reasoning_timeout`` passed). Started and not ended: the request ended in it
        self.reasoning_started: float | None = None
        self.reasoning_ended: float | None = None
        self.reasoning_tokens = 0
        self.reasoning_ended_by: str | None = None
        #: when the first token after the reasoning's end marker was sampled (shown or
        #: not: an answer's leading white space is never shown)
        self.answer_started: float | None = None
        #: what the request asks: ``generate``, ``embed``, ``rerank`` or ``transcribe``
        self.kind = "generate"
        #: the inputs of an embed or rerank request (0 for generation)
        self.inputs = 0
        #: the seconds of audio a transcription holds (0 for any other kind)
        self.audio_seconds = 0.0
        #: a code completion: its prompt is a fill-in-the-middle one (``Infill``)
        self.infill = False
        # What the engine had read and generated when the stop came: what it computes
        # after that is ``tokens_after_stop`` (None: no stop).
        self._read_at_stop: int | None = None
        self._made_at_stop = 0
        self._observers: list[Observer] = list(observers)
        self._lock = threading.Lock()
        # Events wait here in the order their facts were recorded; ``flush`` delivers them.
        self._pending: collections.deque[TraceEvent] = collections.deque()
        self._emitted: list[str] = []
        self._flushing = False
        self._released_event = threading.Event()
        # Anchors monotonic times to the wall clock for serialisation.
        self._wall_anchor = time.time() - clock()

    # -- observers ---------------------------------------------------------------------------

    def subscribe(self, observer: Observer) -> None:
        """Call ``observer`` for every later event of this request."""
        with self._lock:
            self._observers.append(observer)

    def _record_locked(self, kind: str, at: float) -> None:
        """Queue an event for delivery; the caller holds ``_lock`` and set the fact first."""
        self._pending.append(TraceEvent(kind, self, at))

    def flush(self) -> None:
        """Deliver recorded events to the observers, in the order they were recorded.

        One thread delivers at a time and it delivers every pending event, so an event
        recorded on one thread never overtakes an earlier one recorded on another (a
        ``released`` never reaches an observer before its ``ended``). A thread that
        finds another one delivering leaves its events to it and returns at once: an
        engine thread never waits on another thread's observers. ``wait_released``
        returns only once the observers have seen the release.
        """
        with self._lock:
            if self._flushing:
                return
            self._flushing = True
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        self._flushing = False
                        return
                    event = self._pending.popleft()
                    self._emitted.append(event.kind)
                    observers = list(self._observers)
                self._deliver(event, observers)
        except BaseException:
            with self._lock:
                self._flushing = False
            raise

    def _deliver(self, event: TraceEvent, observers: list[Observer]) -> None:
        if _invariants.enabled:
            _invariants.check(event, self._emitted)
        for observer in observers:
            try:
                observer(event)
            except Exception:
                logger.exception("trace observer %r failed on %s", observer, event.kind)
        if event.kind == "released":
            self._released_event.set()

    def _record(self, name: str, at: float | None) -> bool:
        """Set timestamp ``name`` once and queue its event; False if it was already set."""
        when = self.clock() if at is None else at
        with self._lock:
            if getattr(self, name) is not None:
                return False
            setattr(self, name, when)
            self._record_locked(name, when)
        return True

    def _mark(self, name: str, at: float | None) -> bool:
        recorded = self._record(name, at)
        self.flush()
        return recorded

    # -- marks -------------------------------------------------------------------------------

    def mark_enqueued(self, at: float | None = None) -> None:
        self._mark("enqueued", at)

    def mark_admitted(self, at: float | None = None) -> None:
        self._mark("admitted", at)

    def mark_token(self, at: float | None = None) -> None:
        """Record one produced token: sets ``first_token`` once, ``last_token`` always,
        and the gap since the previous token (time waiting on a full belt included)."""
        when = self.clock() if at is None else at
        if self.last_token is not None:
            self.token_gaps.append(when - self.last_token)
        self.last_token = when
        if self.first_token is None:
            self._mark("first_token", when)

    def record_end(
        self,
        reason: EndReason,
        error: BaseException | None = None,
        *,
        cancel_at: float | None = None,
    ) -> bool:
        """Record the end reason (and, for a stop, ``cancel_requested``) without delivering.

        The belt calls this under its own lock, so no thread can act on an end before
        the trace holds it; the belt then calls ``flush()`` outside the lock. Only the
        first end counts: returns True if this call recorded it.
        """
        watch = False
        with self._lock:
            if self.end_reason is not None:
                return False
            if cancel_at is not None and self.cancel_requested is None:
                self.cancel_requested = cancel_at
                self._note_stop_locked()
                self._record_locked("cancel_requested", cancel_at)
                watch = self.released is None
            self.end_reason = reason
            if error is not None:
                self.error = f"{type(error).__name__}: {error}"
            self._record_locked("ended", self.clock())
        if watch:
            _WATCH.watch(self)
        return True

    def _note_stop_locked(self) -> None:
        """Hold what the engine had read and generated at the stop (under ``_lock``).
        The counters are the engine's (a step in flight updates them after it ends):
        whatever they gain from here on was computed for a request already stopped."""
        self._read_at_stop = self.prompt_read
        self._made_at_stop = self.completion_tokens

    def mark_cancel_requested(self, at: float | None = None) -> None:
        """Record a stop; if the release has not come ``release_lag_threshold`` seconds
        later, the ``release_lag`` alert fires then, not only when (if ever) it comes."""
        with self._lock:
            if self.cancel_requested is None:
                self._note_stop_locked()
        if self._mark("cancel_requested", at) and self.released is None:
            _WATCH.watch(self)

    def _alert_lag(self, message: str, lag: float) -> None:
        with self._lock:
            if self.release_lagged:
                return
            self.release_lagged = True
            self._record_locked("release_lag", self.clock())
        logger.warning(message, self.request_id, lag * 1000)
        self.flush()

    def mark_ended(self, reason: EndReason, error: BaseException | None = None) -> bool:
        """Record the end reason and deliver it; only the first call counts."""
        recorded = self.record_end(reason, error)
        self.flush()
        return recorded

    def mark_released(self, at: float | None = None) -> None:
        """The engine is done with the request: producer exited, slot free."""
        if not self._record("released", at):
            return
        self.flush()
        lag = self.cancel_to_release
        if lag is not None and lag > self.release_lag_threshold:
            self._alert_lag("request %s released %.0f ms after it was asked to stop", lag)

    def mark_reasoning(
        self, tokens: int, ended_by: str | None = None, at: float | None = None
    ) -> None:
        """The reasoning phase's progress: its first call marks its start, one with
        ``ended_by`` its end (once); ``tokens`` is its token count so far."""
        when = self.clock() if at is None else at
        if self.reasoning_started is None:
            self.reasoning_started = when
        self.reasoning_tokens = tokens
        if ended_by is not None and self.reasoning_ended is None:
            self.reasoning_ended = when
            self.reasoning_ended_by = ended_by

    def mark_answer(self, at: float | None = None) -> None:
        """The first token of the answer after a reasoning phase was sampled (once)."""
        if self.answer_started is None:
            self.answer_started = self.clock() if at is None else at

    @property
    def phase(self) -> str | None:
        """``reasoning`` while (or if the request ended while) the reasoning phase was
        open, ``answer`` after it, None for a request without one."""
        if self.reasoning_started is None:
            return None
        return "reasoning" if self.reasoning_ended is None else "answer"

    def wait_released(self, timeout: float | None = None) -> bool:
        """Block until the release is recorded; False if ``timeout`` passed first."""
        return self._released_event.wait(timeout)

    # -- derived -----------------------------------------------------------------------------

    @staticmethod
    def _span(start: float | None, end: float | None) -> float | None:
        if start is None or end is None:
            return None
        return max(0.0, end - start)

    @property
    def queue_wait(self) -> float | None:
        """Seconds from enqueue to admission."""
        return self._span(self.enqueued, self.admitted)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from enqueue to the first token (queue wait included)."""
        return self._span(self.enqueued, self.first_token)

    @property
    def cancel_to_release(self) -> float | None:
        """Seconds from the stop request to the release of the engine."""
        return self._span(self.cancel_requested, self.released)

    @property
    def end_to_end(self) -> float | None:
        """Seconds from enqueue to release."""
        return self._span(self.enqueued, self.released)

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second between the first and the last token."""
        span = self._span(self.first_token, self.last_token)
        if not span or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / span

    @property
    def tokens_after_stop(self) -> int:
        """Tokens computed after the request was asked to stop: prompt tokens read into
        the KV cache since (those the prefix cache gave are not computed) and tokens
        generated since; 0 without a stop. A batch engine's step in flight at the stop
        counts here (its prefill chunk; its sampled token is dropped, not generated)."""
        if self._read_at_stop is None:
            return 0
        read = max(0, self.prompt_read - max(self._read_at_stop, self.cached_tokens))
        return read + max(0, self.completion_tokens - self._made_at_stop)

    @property
    def real_time_factor(self) -> float | None:
        """A transcription's seconds of work (admitted to released) per second of audio
        (below 1: faster than the audio plays); None for other kinds, or until released."""
        span = self._span(self.admitted, self.released)
        if not self.audio_seconds or span is None:
            return None
        return round(span / self.audio_seconds, 4)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view: times in ms after ``enqueued``, durations in ms."""
        origin = self.enqueued if self.enqueued is not None else self.admitted

        def rel(value: float | None) -> float | None:
            if value is None or origin is None:
                return None
            return round((value - origin) * 1000, 3)

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 3)

        return {
            "request_id": self.request_id,
            "model": self.model,
            "kind": self.kind,
            "infill": self.infill,
            "inputs": self.inputs,
            "audio_seconds": self.audio_seconds,
            "real_time_factor": self.real_time_factor,
            "enqueued_at": None if origin is None else round(self._wall_anchor + origin, 6),
            "timeline_ms": {name: rel(getattr(self, name)) for name in TIMESTAMPS},
            "queue_wait_ms": ms(self.queue_wait),
            "time_to_first_token_ms": ms(self.time_to_first_token),
            "cancel_to_release_ms": ms(self.cancel_to_release),
            "end_to_end_ms": ms(self.end_to_end),
            "decode_tok_s": None if self.decode_rate is None else round(self.decode_rate, 3),
            "prompt_tokens": self.prompt_tokens,
            "dropped_messages": self.dropped_messages,
            "cached_tokens": self.cached_tokens,
            "prompt_read": self.prompt_read,
            "completion_tokens": self.completion_tokens,
            "tokens_after_stop": self.tokens_after_stop,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "draft_decision": self.draft_decision,
            "buffer_peak": self.buffer_peak,
            "end_reason": None if self.end_reason is None else self.end_reason.value,
            "stop_sequence": self.stop_sequence,
            "error": self.error,
            "release_lagged": self.release_lagged,
            "batched_with": sorted(self.batched_with),
            "upstream": self.upstream,
            "worker": self.worker,
            "reasoning": None
            if self.reasoning_started is None
            else {
                "started_ms": rel(self.reasoning_started),
                "ended_ms": rel(self.reasoning_ended),
                "tokens": self.reasoning_tokens,
                "ended_by": self.reasoning_ended_by,
                "answer_started_ms": rel(self.answer_started),
                # the phase the request was in when it ended (or is in now)
                "phase": self.phase,
            },
        }

    def __repr__(self) -> str:
        reason = self.end_reason.value if self.end_reason else None
        return f"<Trace {self.request_id} end_reason={reason!r}>"


class _ReleaseWatch:
    """One process-wide thread that raises ``release_lag`` for stops not yet released.

    Without it, a request whose engine never lets go would never alert: the check at
    release time needs a release.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Trace]] = []
        self._thread: threading.Thread | None = None
        #: alerts that raised (logged; the thread went on)
        self.failures = 0

    def watch(self, trace: Trace) -> None:
        deadline = time.monotonic() + trace.release_lag_threshold
        with self._cond:
            heapq.heappush(self._heap, (deadline, id(trace), trace))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tokenbelt-release-watch", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline, _, trace = self._heap[0]
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                heapq.heappop(self._heap)
            try:
                if trace.released is None and trace.cancel_requested is not None:
                    lag = trace.clock() - trace.cancel_requested
                    trace._alert_lag("request %s still not released %.0f ms after its stop", lag)
            except Exception:
                # One trace's alert (its clock, an observer) must not end the thread every
                # later request's alert waits on: say so, count it, and go on.
                self.failures += 1
                logger.exception("a release-lag alert failed; the release watch goes on")


_WATCH = _ReleaseWatch()
