"""The engine worker process: a ``BatchEngine`` behind a pipe.

Started by ``WorkerEngine`` as ``python -m tokenbelt.engines.worker._child FD``, where
``FD`` is this end of a socket pair. The first message (``Load``) names the model file
and the engine's configuration (``LlamaConfig``); the worker loads it, answers ``Ready``
(or ``LoadError``) and then serves messages until the parent says ``Close`` or goes away
(end of file). The messages are the records of ``_messages.py``.

The batch engine runs here unchanged: each request gets a ``_Forward`` producer, which
sends everything the engine does to the request (admit, counts, items, the end, the
release) to the parent, and knows the room the parent granted (credits). It never
holds more than its credits: the parent grants room as its reader takes items, so the
engine is never more than the belt's capacity ahead of the reader.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, cast

from ..._errors import Cancelled, IllegalState, TokenbeltError
from ..._heap import freeze_startup_heap
from ...belt import EndReason, Producer, Trace
from .._statistics import BatchStatistics
from ..llama import BatchEngine
from ._messages import (
    Admit,
    Cached,
    Cancel,
    Close,
    Credit,
    Fail,
    Finish,
    Item,
    Load,
    LoadError,
    Ping,
    Pong,
    Prompt,
    Read,
    Ready,
    Reasoning,
    Release,
    Start,
    ToParent,
    ToWorker,
    decode,
    encode,
    input_waiter,
    step_of,
)

#: a test-only crash point, set by the parent for its first worker: "prefill" or "decode"
#: (a native abort there), or "slow_stop" (the step in flight when a stop comes runs long)
ABORT_POINTS = ("prefill", "decode", "slow_stop")
#: "slow_stop": seconds each graph node of the step takes, and at most this many nodes
#: (about 2.5 s for a step of the default model, which has about 600)
_SLOW_NODE_S = 0.004
_SLOW_NODES = 1000


class _Link:
    """This end of the pipe: one lock, so messages from several threads stay whole.

    While the engine samples a step (``held``), what its loop sends waits and goes as one
    ``Step`` frame at the step's end; a message another thread sends meanwhile first
    writes what waits, so the order of the sends is the order on the pipe. A request's
    admission is held the same way (its start with its prompt's count, then what the
    prefix cache held): each frame is a write here and a wake-up of the parent's reader,
    and a first token after a cache hit took six of them, three now.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        #: the engine's counters, sent with each release for the parent's metrics
        self.stats: Callable[[], BatchStatistics] | None = None
        self._held: list[tuple[Any, ...]] = []
        self._holder: int | None = None  # the thread whose sends wait, while it samples

    def send(self, message: ToParent) -> None:
        wire = encode(message)
        with self._lock:
            if self._holder == threading.get_ident():
                self._held.append(wire)
                return
            self._write_held_locked()
            self._write_locked(wire)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """What this thread sends inside goes as one frame when it leaves."""
        with self._lock:
            self._holder = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._holder = None
                self._write_held_locked()

    def _write_held_locked(self) -> None:
        if self._held:
            wires, self._held = self._held, []
            self._write_locked(step_of(wires))

    def _write_locked(self, wire: tuple[Any, ...]) -> None:
        # Plain pickle, in Connection's framing: ``Connection.send`` pickles with
        # multiprocessing's ForkingPickler, which copies the copyreg table for each
        # frame (2.7 against 0.3 us a frame, on the decode loop's thread, every token);
        # a wire tuple holds nothing its reducers are for.
        data = pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)
        # The parent is gone when this fails: the reader sees the end and exits.
        with contextlib.suppress(OSError):
            self.conn.send_bytes(data)


class _Forward(Producer[Any]):
    """A request's producer end in the worker: forwards to the parent's belt.

    ``has_room``/``on_room``/``wait_for_room`` reflect the credits the parent granted;
    ``on_cancel`` callbacks run when the parent's cancel arrives.
    """

    __slots__ = (
        "_callbacks",
        "_capacity",
        "_cond",
        "_crash",
        "_credit",
        "_link",
        "_reason",
        "_room",
        "_tokens",
        "_trace",
        "rid",
    )

    def __init__(
        self, link: _Link, rid: int, request_id: str, capacity: int, crash: _Crash | None
    ) -> None:
        self._link = link
        self.rid = rid
        self._capacity = capacity
        self._trace = Trace(request_id)
        self._cond = threading.Condition()
        self._credit = capacity
        self._reason: EndReason | None = None
        self._callbacks: list[Callable[[EndReason], None]] = []
        self._room: list[Callable[[], None]] = []
        self._tokens = 0  # counted since the last message that carried the count
        self._crash = crash

    # -- state -------------------------------------------------------------------------------

    @property
    def trace(self) -> Trace:
        return self._trace

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def cancelled(self) -> bool:
        return self._reason is not None and self._reason.is_cancel

    @property
    def end_reason(self) -> EndReason | None:
        return self._reason

    # -- from the parent ---------------------------------------------------------------------

    def grant(self, n: int) -> None:
        """The parent's reader took ``n`` items: that much more room."""
        with self._cond:
            self._credit += n
            callbacks, self._room = self._room, []
            self._cond.notify_all()
        for callback in callbacks:
            callback()

    def stop(self, reason: EndReason) -> None:
        """The parent's belt was cancelled: end here too and tell the engine."""
        with self._cond:
            if self._reason is not None:
                return
            self._reason = reason
            callbacks, self._callbacks = self._callbacks, []
            room, self._room = self._room, []
            self._cond.notify_all()
        for wake in room:
            wake()
        for callback in callbacks:
            callback(reason)

    # -- the producer contract ---------------------------------------------------------------

    def has_room(self) -> bool:
        return self.room() > 0

    def room(self) -> int:
        with self._cond:
            return 0 if self._reason is not None else max(0, self._credit)

    def on_room(self, callback: Callable[[], None]) -> bool:
        with self._cond:
            if self._reason is not None or self._credit > 0:
                return False
            self._room.append(callback)
            return True

    def wait_for_room(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._reason is not None or self._credit > 0)
            if self._reason is not None:
                raise Cancelled(self._reason)

    def checkpoint(self) -> None:
        reason = self._reason
        if reason is not None:
            raise Cancelled(reason)

    def put_nowait(self, item: Any) -> None:
        with self._cond:
            if self._reason is not None:
                raise Cancelled(self._reason)
            if self._credit <= 0:
                raise IllegalState("put_nowait on a full belt: check has_room() first")
            self._credit -= 1
            tokens, self._tokens = self._tokens, 0
        self._link.send(Item(self.rid, item, tokens))
        if self._crash is not None:
            self._crash.arm("decode")

    def put(self, item: Any) -> None:
        self.wait_for_room()
        self.put_nowait(item)

    def on_cancel(self, callback: Callable[[EndReason], None]) -> None:
        with self._cond:
            if self._reason is None:
                self._callbacks.append(callback)
                return
            fire = self.cancelled
        if fire:
            assert self._reason is not None
            callback(self._reason)

    def start(self) -> None:
        self._link.send(Admit(self.rid))

    def _end(self, reason: EndReason) -> tuple[bool, int]:
        with self._cond:
            if self._reason is not None:
                return False, 0
            self._reason = reason
            self._callbacks = []
            tokens, self._tokens = self._tokens, 0
            self._cond.notify_all()
        return True, tokens

    def finish(self, reason: EndReason = EndReason.STOP) -> bool:
        ended, tokens = self._end(reason)
        if ended:
            self._link.send(Finish(self.rid, reason, tokens, self._trace.stop_sequence))
        return ended

    def fail(self, error: BaseException) -> bool:
        ended, tokens = self._end(EndReason.RUNTIME_ERROR)
        if ended:
            self._link.send(Fail(self.rid, str(error) or type(error).__name__, tokens))
        return ended

    def cancel(self, reason: EndReason) -> bool:
        with self._cond:
            if self._reason is not None:
                return False
            self._reason = reason
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        self._link.send(Cancel(self.rid, reason))
        for callback in callbacks:
            callback(reason)
        return True

    def release(self) -> None:
        # Set at release so that the parent's trace lists every batch this one was in.
        peers = sorted(self._trace.batched_with)
        stats = self._link.stats() if self._link.stats is not None else None
        t = self._trace
        with self._cond:  # a cancel sends no count: the tokens sampled since go here
            tokens, self._tokens = self._tokens, 0
        self._link.send(
            Release(
                self.rid,
                peers,
                stats,
                t.draft_tokens,
                t.accepted_draft_tokens,
                tokens,
                t.draft_decision,
            )
        )

    def count_prompt(self, tokens: int) -> None:
        self._link.send(Prompt(self.rid, tokens))
        if self._crash is not None:
            self._crash.arm("prefill")

    def count_cached(self, tokens: int) -> None:
        self._link.send(Cached(self.rid, tokens))

    def count_read(self, tokens: int) -> None:
        self._link.send(Read(self.rid, tokens))

    def count_draft(self, drafted: int, accepted: int, decision: str) -> None:
        # Sent with the release: the engine counts them once, as it lets go.
        self._trace.draft_tokens, self._trace.accepted_draft_tokens = drafted, accepted
        self._trace.draft_decision = decision

    def note_reasoning(self, tokens: int, ended_by: str | None = None) -> None:
        self._link.send(Reasoning(self.rid, time.monotonic(), tokens, ended_by))

    def note_answer(self) -> None:
        self._link.send(Reasoning(self.rid, time.monotonic(), 0, None, answer=True))

    def count_token(self) -> None:
        with self._cond:
            self._tokens += 1


class _Crash:
    """Test-only: a real native ``abort()`` inside the next ``llama_decode`` once armed,
    or (``slow_stop``) a long step.

    llama.cpp calls the engine's abort hook between graph nodes; this hook stands in for
    it (it still reads the engine's stop flag) and, once armed at its point (a prompt
    about to be computed, or a token produced), aborts the process from inside the step.
    Armed by a stop, ``slow_stop`` makes each node of the step in flight take
    ``_SLOW_NODE_S`` until the step is aborted (or ``_SLOW_NODES`` passed): the step a
    stop lands in runs for seconds, as steps do on a machine whose cores are busy.
    """

    def __init__(self, engine: BatchEngine, point: str) -> None:
        self.point = point
        self._armed = False
        self._nodes = 0
        engine.wrap_abort_hook(self._hook)

    def _hook(self, stopped: bool) -> bool:
        if self._armed:
            if self.point != "slow_stop":
                os.abort()
            self._nodes += 1
            if stopped or self._nodes > _SLOW_NODES:
                self._armed = False
            else:
                time.sleep(_SLOW_NODE_S)
        return stopped

    def arm(self, point: str) -> None:
        if point == self.point:
            self._nodes = 0
            self._armed = True


class _Worker:
    def __init__(self, link: _Link, engine: BatchEngine, crash: _Crash | None) -> None:
        self.link = link
        self.engine = engine
        self.crash = crash
        self.requests: dict[int, _Forward] = {}

    def serve(self) -> None:
        """Handle the parent's messages until ``close`` or the end of the pipe."""
        conn = self.link.conn
        # Not woken each time the parent takes a frame the engine's loop wrote, once a
        # token, on the cores llama.cpp's threads use (``input_waiter``).
        wait = input_waiter(conn)
        while True:
            try:
                wait()
                message = cast(ToWorker, decode(conn.recv()))
            except (EOFError, OSError):
                return
            match message:
                case Credit(rid, n):
                    found = self.requests.get(rid)
                    if found is not None:
                        found.grant(n)
                case Cancel(rid, reason):
                    found = self.requests.pop(rid, None)
                    if self.crash is not None:
                        self.crash.arm("slow_stop")
                    if found is not None:
                        found.stop(reason)
                case Start():
                    self._start(message)
                case Ping(n):
                    # Answered by the engine's loop between two steps: a loop stuck in a
                    # step (or a frozen process) answers nothing.
                    self.engine.between_steps(functools.partial(self.link.send, Pong(n)))
                case Close():
                    return

    def _start(self, message: Start) -> None:
        rid, request = message.rid, message.request
        producer = _Forward(self.link, rid, message.request_id, message.capacity, self.crash)
        self.requests[rid] = producer
        # Off the engine's loop, as the runtime does in-process: the parent's tokens (its
        # vocabulary is this model's), else tokenized here. A prompt that fails here
        # fails again in the loop, which ends the request with the error.
        with contextlib.suppress(Exception):
            if message.tokens is not None:
                self.engine.keep_prompt_tokens(request, message.tokens)
            else:
                self.engine.count_prompt_tokens(request)
        self.engine.start(request, producer, lambda: self._forget(rid))

    def _forget(self, rid: int) -> None:
        self.requests.pop(rid, None)


def _info(engine: BatchEngine) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "context_length": engine.context_length,
        "slots": engine.slots,
        "n_threads": engine.n_threads,
        "n_threads_batch": engine.n_threads_batch,
        "n_ctx_train": engine.n_ctx_train,
        "n_batch": engine.n_batch,
    }


def _say_sigterm_waits(signum: int, frame: object) -> None:
    os.write(
        2,
        f"engine worker {os.getpid()}: SIGTERM ignored: the server ends its worker when it "
        "shuts down (SIGKILL ends it now)\n".encode(),
    )


def main(argv: list[str]) -> int:
    # A Ctrl-C in a terminal reaches the whole process group, and so does a service
    # manager's SIGTERM (systemd's stop signals every process of the unit): the parent
    # decides when its worker ends (it closes the pipe), so the worker ignores both, or a
    # server's graceful shutdown would begin with its worker's crash and a restart.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _say_sigterm_waits)
    link = _Link(Connection(int(argv[1])))
    try:
        load = decode(link.conn.recv())
    except (EOFError, OSError):
        return 1
    if not isinstance(load, Load):
        return 1
    try:
        engine = BatchEngine(load.path, load.config)
    except TokenbeltError as exc:
        link.send(LoadError(str(exc)))
        return 1
    crash = _Crash(engine, load.crash_point) if load.crash_point in ABORT_POINTS else None
    worker = _Worker(link, engine, crash)
    link.stats = engine.statistics
    engine.around_sampling(link.held)
    freeze_startup_heap()
    link.send(Ready(_info(engine)))
    try:
        worker.serve()
    finally:
        engine.close()
        link.conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
