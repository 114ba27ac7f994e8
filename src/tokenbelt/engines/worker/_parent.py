"""The engine in a worker process: a native crash ends requests, not the service.

``WorkerEngine`` looks to the runtime like a ``BatchEngine`` (``slots``, a non-blocking
``start``); the model and the batch engine live in a child process
(``_child.py``), spawned with a fresh interpreter, never forked. The parent keeps
admission, deadlines, traces, metrics and the belts; across the pipe go:

- **backpressure as credits**: the worker may send as many items as the parent
  granted, starting at the belt's capacity; the parent grants more as its reader takes
  items (half a belt at a time, or at once when the worker has none left), so the
  worker is never more than the belt's capacity ahead of the reader;
- **stops**: a belt's cancel is posted to the worker (never sent on the cancelling
  thread, which may be the event loop); the request counts as released only when the
  worker says so. A stop the worker has not honoured within ``stop_grace`` seconds
  kills the worker: the request's trace records the kill (``trace.worker``) and its
  release, and the release-lag alert fires;
- **crashes**: when the worker dies (a signal, an exit), every request it held ends
  ``runtime_error`` with ``WorkerCrashed`` naming the cause and is released; requests
  it had not admitted yet, and those not yet sent to a worker, wait for the next worker
  (their deadlines still apply), and a new worker starts (at once after
  a first crash, then with a growing backoff). Workers that die before they are ready
  ``max_load_crashes`` times in a row mark the engine failed: requests then end at once
  with the reason.

Prompts are tokenized in the parent, with the model's vocabulary only (``_vocab.py``).
The engine's state, its restarts, the heartbeat and the kills (a stop's grace, a load's
deadline) are its ``Supervision``'s (``_supervision.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._errors import (
    DecodeError,
    IllegalState,
    InvalidArgument,
    ModelLoadError,
    WorkerCrashed,
)
from ...belt import EndReason, Producer, check_duration
from .._base import OnExit, run_to_end
from .._embedding import EmbeddingInfo, EmbeddingRequest
from .._infill import Infill, InfillPrompt
from .._request import GenerationRequest
from .._statistics import BatchStatistics, WorkerState, WorkerStatistics
from ..llama import LlamaConfig, check_gguf_file, check_inputs, check_pooling
from . import _messages as msg
from ._jobs import Job
from ._process import Process, describe_exit, spawn
from ._supervision import Supervision
from ._vocab import PromptTokens

logger = logging.getLogger("tokenbelt.engines.worker")

#: a test-only crash point for the first worker (see ``_child._Crash``)
ABORT_ENV = "TOKENBELT_TEST_WORKER_ABORT"
#: default seconds a stop may take before the worker is killed
DEFAULT_STOP_GRACE = 3.0
#: seconds a failed engine thread waits before it starts again
_RESTART_PAUSE_S = 0.05


class WorkerEngine:
    """A ``BatchEngine`` in a worker process, driven like one (``slots``, ``start``).

    ``start(request, producer, on_exit)`` never blocks: the request is posted to the
    worker (or waits for the next one while a worker restarts). The producer sees what
    it would see in-process: admission, counts, items (within the belt's capacity of
    the reader), one end, one release. ``stop_grace`` bounds every stop: a worker that
    has not released a stopped request by then is killed. Options other than those
    named here go to the ``BatchEngine`` in the worker.
    """

    def __init__(
        self,
        model_path: str | Path,
        config: LlamaConfig | None = None,
        *,
        stop_grace: float = DEFAULT_STOP_GRACE,
        load_timeout: float | None = None,
        max_load_crashes: int = 3,
        **options: Any,
    ) -> None:
        if options or config is None:
            config = LlamaConfig.of(config, **options)
        path = check_gguf_file(model_path)
        check_pooling(config.pooling, path)
        self.model_path = path
        self.name = config.name or path.stem
        #: what the worker's ``BatchEngine`` is made with (sent whole in ``Load``)
        self.config = dataclasses.replace(config, name=self.name)
        self.slots = config.slots  # llama.cpp's sequence limit
        self.context_length = config.n_ctx
        grace = check_duration("stop_grace", stop_grace, allow_zero=False)
        if grace is None:
            raise InvalidArgument("stop_grace must be a number of seconds, got None")
        self.stop_grace = grace
        self.load_timeout = load_timeout
        self._watch = Supervision(
            stop_grace=grace, load_timeout=load_timeout, max_load_crashes=max_load_crashes
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._jobs: dict[int, Job] = {}
        self._pending: list[Job] = []  # started while no worker was ready
        self._doomed: list[tuple[Job, BaseException]] = []  # to end off the caller's thread
        self._ids = itertools.count(1)
        self._closed = False
        self._stats: BatchStatistics | None = None
        self._numbers = itertools.count(1)
        self._current: Process
        self._prompts = PromptTokens(
            self.model_path,
            self.name,
            context_length=self.context_length,
            reasoning=config.reasoning,
        )
        self._embedding: EmbeddingInfo | None = None
        #: whether the GGUF's chat template renders tools (then requests carry ``tools``)
        self.template_tools = self._prompts.template_tools
        self.tool_format = self._prompts.tool_format
        #: a thinking model's reasoning markers (as the worker's ``BatchEngine`` has them)
        self.reasoning = self._prompts.reasoning
        #: the FIM tokens its vocabulary has (``FillsMiddle``)
        self.fim_tokens = self._prompts.fim_tokens
        crash_point = os.environ.get(ABORT_ENV) or None
        try:
            first = self._spawn(crash_point)
        except BaseException:
            self._prompts.close()
            raise
        # Three threads serve every worker this engine starts, one after another: the
        # reader, the sender (the one place that writes to the pipe; it may block) and
        # the supervisor (grace kills, restarts, the heartbeat).
        self._threads = [
            threading.Thread(
                target=functools.partial(self._keep_running, role, target),
                name=f"tokenbelt-worker-{role}-{self.name}",
                daemon=True,
            )
            for role, target in (
                ("read", self._reader),
                ("send", self._sender),
                ("watch", self._supervise),
            )
        ]
        for thread in self._threads:
            thread.start()
        try:
            first.wait_ready(self.load_timeout, self.model_path.name)
        except BaseException:
            self.close()
            raise

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        config: LlamaConfig | None = None,
        *,
        load_timeout: float | None = None,
        **options: Any,
    ) -> WorkerEngine:
        """Start a worker and wait until it has loaded the model (``load_timeout``)."""
        return cls(model_path, config, load_timeout=load_timeout, **options)

    # -- the parent's own view of the model --------------------------------------------------

    def tokenize_request(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens for a request, as the worker's engine makes them."""
        return self._prompts.tokenize(request)

    def infill_prompt(self, infill: Infill, max_tokens: int) -> InfillPrompt:
        """The fill-in-the-middle prompt of ``infill`` (``FillsMiddle``)."""
        return self._prompts.infill(infill, max_tokens)

    def count_prompt_tokens(self, request: GenerationRequest | EmbeddingRequest) -> int:
        """Check and tokenize in this process (vocabulary only), so a bad request never
        reaches the worker; raises ``InvalidArgument`` or ``PromptTooLong``."""
        if isinstance(request, EmbeddingRequest):
            return check_inputs(request, self.embedding_info())
        return self._prompts.count(request)

    def remember_prompt_tokens(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Keep ``tokens``, just made by ``tokenize_request``, for ``request``'s count and
        start (a chat fitted to its window is not tokenized again)."""
        self._prompts.remember(request, tokens)

    def embedding_info(self) -> EmbeddingInfo:
        """The model's embeddings as the worker's engine makes them (from the metadata)."""
        if self._embedding is None:
            pooling = self.config.pooling
            self._embedding = self._prompts.embedding_info(pooling, self.context_length)
        return self._embedding

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        return self._prompts.inputs(texts)

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[list[int]]:
        return self._prompts.pairs(query, documents)

    # -- worker processes --------------------------------------------------------------------

    def _spawn(self, crash_point: str | None = None) -> Process:
        """Start a worker process and send it the model to load; does not wait."""
        w = spawn(next(self._numbers), msg.Load(str(self.model_path), self.config, crash_point))
        self._watch.spawned(w)
        with self._cond:
            closed = self._closed
            if not closed:
                # Before its first message: its "ready" must find it the current worker.
                self._current = w
                self._cond.notify_all()  # the reader and the sender move on to it
        if closed:
            w.kill("the engine closed")
            w.popen.wait()
            w.close_pipe()
            return w
        logger.info("engine worker %s started for %s", w.pid, self.name)
        return w

    def _next(self, w: Process) -> Process | None:
        """Wait for the worker after ``w``; None once the engine closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._current is not w)
            return None if self._current is w else self._current

    def _keep_running(self, role: str, target: Callable[[], None]) -> None:
        """Run ``target`` until it returns; one that fails is logged, counted
        (``thread_failures``) and started again after a short pause (one that fails each
        time does not spin), never left dead in silence: without the reader no reply
        arrives and no crash is seen, without the sender nothing reaches the worker,
        without the supervisor no stop is bounded and no heartbeat is sent."""
        while True:
            try:
                target()
                return
            except Exception:
                with self._lock:
                    self._watch.thread_failures += 1
                logger.exception("the %s thread of %s failed; it starts again", role, self.name)
                with self._cond:
                    if self._cond.wait_for(lambda: self._closed, _RESTART_PAUSE_S):
                        return

    def _sender(self) -> None:
        w: Process | None = self._current
        while w is not None:
            w.send_queued()  # until it is gone
            w = self._next(w)

    def _reader(self) -> None:
        w: Process | None = self._current
        while w is not None:
            # A reader started again after a failure goes on with the current worker,
            # unless that one's end was already seen (then it waits for the next).
            if not w.done:
                code = w.read(functools.partial(self._handle, w))  # until it is gone
                self._gone(w, code)
            w = self._next(w)

    def _handle(self, w: Process, message: msg.ToParent) -> None:
        match message:
            case msg.Ready(info):
                self._ready(w, info)
                return
            case msg.LoadError(error):
                w.load_error = error
                return
            case msg.Pong():
                self._watch.answered(w)
                return
        job = self._jobs.get(message.rid)
        if job is None or job.worker is not w:
            return
        if job.apply(message):
            self._grant(job)  # an item reached the belt: the room the reader made
        elif isinstance(message, msg.Release):
            if message.statistics is not None:
                self._stats = message.statistics
            self._release(job)

    def _ready(self, w: Process, info: dict[str, Any]) -> None:
        with self._lock:
            w.info = info
            if not self._watch.ready(w, current=not self._closed and w is self._current):
                return
            self._cond.notify_all()  # the supervisor starts the heartbeat
            pending, self._pending = self._pending, []
            for job in pending:
                self._send_start(job, w)
        w.ready.set()
        logger.info("engine worker %s is ready for %s", w.pid, self.name)

    def _send_start(self, job: Job, w: Process) -> None:
        """Hand a job to a worker (under ``_lock``)."""
        job.worker = w
        trace = job.producer.trace
        trace.worker = {"pid": w.pid}
        tokens = self._prompts.kept(job.request)  # None: the worker makes them
        w.post(msg.Start(job.rid, trace.request_id, job.request, job.capacity, tokens))

    def _gone(self, w: Process, code: int) -> None:
        """A worker process ended: end and release what it held; start another."""
        cause = w.cause or describe_exit(code)
        with self._cond:
            w.done = True
            held = [job for job in self._jobs.values() if job.worker is w]
            expected = self._closed and w.cause is None
            if not expected:
                # What it had not admitted yet waits for the next worker, ahead of what
                # came later (its deadlines still run); only what it ran ends here.
                waiting = [j for j in held if not j.admitted and j.stop_by is None]
                for job in waiting:
                    job.unsent()
                self._pending[:0] = waiting
                held = [j for j in held if j.worker is w]
                current = not self._closed and w is self._current
                failure = self._watch.crashed(w, cause, current=current)
                if failure is not None:
                    self._fail_locked(failure)
                    logger.error("model %s failed: %s", self.name, failure)
            self._cond.notify_all()
        with w.cond:
            w.done = True
            w.outbox.clear()
            w.cond.notify_all()
        w.ready.set()
        if not expected:
            logger.error("%s (model %s)", cause, self.name)
        error = WorkerCrashed(cause)
        for job in held:
            self._end(job, error)

    def _fail_locked(self, failure: str, *, crash: bool = False) -> None:
        """No worker can serve: the engine fails, and what waited for one ends with why."""
        self._watch.fail(failure, crash=crash)
        pending, self._pending = self._pending, []
        for job in pending:
            self._jobs.pop(job.rid, None)
            self._doomed.append((job, WorkerCrashed(failure)))
        self._cond.notify_all()

    def _end(self, job: Job, error: BaseException) -> None:
        """End a job its worker can no longer serve, then release it."""
        job.producer.fail(error)  # a no-op after a stop: that reason stays
        self._release(job)

    def _release(self, job: Job) -> None:
        with self._lock:
            if self._jobs.pop(job.rid, None) is None:
                return
        job.let_go()

    # -- credits -----------------------------------------------------------------------------

    def _grant(self, job: Job) -> None:
        """Give the worker the room the reader made; when it has none, wait for a read."""
        while True:
            with self._lock:
                w = job.worker
                if self._jobs.get(job.rid) is not job or w is None:
                    return
                delta, out = job.credit_due()
                if delta > 0 and (out or 2 * delta >= job.capacity):
                    job.granted += delta
                    w.post(msg.Credit(job.rid, delta))
                    return
                if not out:
                    return
            # Out of credits and the belt is full: the read that makes room grants more.
            if job.producer.on_room(
                functools.partial(w.defer, functools.partial(self._grant, job))
            ):
                return
            if job.producer.end_reason is not None:
                return

    # -- requests ----------------------------------------------------------------------------

    def start(
        self, request: GenerationRequest, producer: Producer[Any], on_exit: OnExit | None = None
    ) -> None:
        """Hand a request to the worker; never blocks. Raises ``IllegalState`` when closed."""
        job = Job(next(self._ids), request, producer, on_exit or (lambda: None))
        with self._cond:
            if self._closed:
                raise IllegalState("the engine is closed")
            if self._watch.state is WorkerState.FAILED:
                # Ended on the supervisor's thread: the caller may hold the scheduler's lock.
                failure = self._watch.failure or "the worker failed"
                self._doomed.append((job, WorkerCrashed(failure)))
                self._cond.notify_all()
                return
            self._jobs[job.rid] = job
            if self._watch.state is WorkerState.READY:
                self._send_start(job, self._current)
            else:
                self._pending.append(job)
        producer.on_cancel(lambda reason: self._on_cancel(job, reason))

    def _on_cancel(self, job: Job, reason: EndReason) -> None:
        """On the cancelling thread: post the stop and arm the grace period; never blocks."""
        with self._cond:
            if self._jobs.get(job.rid) is not job:
                return
            w = job.worker
            if w is None:  # never sent: nothing to stop but the wait
                self._pending.remove(job)
                del self._jobs[job.rid]
            else:
                w.post(msg.Cancel(job.rid, reason))
                self._watch.arm_stop(job)
                self._cond.notify_all()
        if w is None:
            job.let_go()

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        """Blocking: run one request, as a thread engine does (see ``BatchEngine.generate``)."""
        return run_to_end(self.start, request, producer)

    # -- the supervisor ----------------------------------------------------------------------

    def _supervise(self) -> None:
        """End what was doomed off its caller's thread; do what the supervision finds due:
        kill a worker that keeps a stopped request past the grace or loads too long,
        start the next worker, send the heartbeat."""
        watch = self._watch
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                doomed, self._doomed = self._doomed, []
                w = self._current
                late, slow_load, restart = watch.due(w, self._jobs.values(), now)
                if not (late or doomed or slow_load or restart):
                    times = watch.wakes(w, self._jobs.values())
                    self._cond.wait(max(0.0, min(times) - now) if times else None)
                    continue
            for job, error in doomed:
                job.producer.start()
                job.end(error)
            for job in late:
                watch.kill_late(job)
            if slow_load:
                watch.kill_slow(w)
            if restart:
                self._restart()

    def _restart(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._watch.restarting()
        try:
            self._spawn()
        except ModelLoadError as exc:
            with self._cond:
                self._fail_locked(str(exc), crash=True)

    # -- state -------------------------------------------------------------------------------

    @property
    def state(self) -> WorkerState:
        return self._watch.state

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None while none runs)."""
        w = self._current
        return None if w.done or self._closed else w.pid

    def worker_statistics(self) -> WorkerStatistics:
        w = self._current
        return self._watch.statistics(w, running=not w.done and not self._closed)

    @property
    def failure(self) -> str | None:
        """Why the engine failed (workers kept dying while loading), or None."""
        return self._watch.failure

    @property
    def threads(self) -> int:
        """The worker's llama.cpp threads, as of its latest release (else its fixed count)."""
        if self._stats is not None:
            return self._stats.threads
        return int(self._current.info.get("n_threads", 0))

    @property
    def n_batch(self) -> int:
        """Most tokens of one step in the worker's engine."""
        return int(self._current.info.get("n_batch", 0))

    def statistics(self) -> BatchStatistics:
        """The worker's batch counters as of its latest release (since it started), with
        the worker process's own (``worker``)."""
        stats = self._stats
        if stats is None:
            stats = BatchStatistics(self.slots, 0, 0, 0, 0, 0, 0, 0, 0, self.threads)
        return dataclasses.replace(stats, worker=self.worker_statistics())

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """End the worker (its memory returns to the system); requests end ``shutdown``.

        Blocks until the worker process has exited (killed if it does not within a
        few seconds). Idempotent.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._watch.close()
            pending, self._pending = self._pending, []
            for job in pending:
                self._jobs.pop(job.rid, None)
            doomed, self._doomed = self._doomed, []
            w = self._current
            self._cond.notify_all()
        for job in pending:
            job.producer.cancel(EndReason.SHUTDOWN)
            job.end(DecodeError("the engine closed"))
        for job, error in doomed:
            job.end(error)
        for job in list(self._jobs.values()):
            job.producer.cancel(EndReason.SHUTDOWN)
        w.stop()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._prompts.close()
