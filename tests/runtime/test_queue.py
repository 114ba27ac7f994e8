"""Slots and the bounded admission queue: cancel while queued, rejection, deadlines, shutdown.

One slot held by a scripted request that waits on a ``gate`` (a step that cannot be
interrupted) keeps everything else in the queue for as long as the test wants; setting
the gate lets the slot go. Nothing here depends on timing but the one deadline test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tokenbelt import (
    EndReason,
    Limits,
    Model,
    ModelState,
    QueueFull,
    Runtime,
    RuntimeClosed,
    SchedulerStatistics,
    ScriptedEngine,
    Stream,
    TraceEvent,
)

from . import NET, Recorder, words

QUEUE_SIZE = 2


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def gate() -> threading.Event:
    return threading.Event()


@pytest.fixture
def runtime(recorder: Recorder, gate: threading.Event) -> Iterator[Runtime]:
    rt = Runtime(slots=1, queue_size=QUEUE_SIZE, observers=[recorder])
    try:
        yield rt
    finally:
        gate.set()  # a step stuck on the gate cannot see a cancel: let it go first
        rt.close()


@pytest.fixture
def gated(runtime: Runtime, gate: threading.Event) -> Model:
    """One slot whose every step waits for ``gate``."""
    return runtime.add_engines("gated", [ScriptedEngine(["a", "b", "c"], delay=0, gate=gate)])


def admitted(recorder: Recorder, stream: Stream) -> None:
    recorder.wait(stream.request_id, "admitted")


def test_cancelling_a_queued_request_removes_it_at_once(
    gated: Model, gate: threading.Event, recorder: Recorder
) -> None:
    running = gated.stream(prompt="one")
    queued = gated.stream(prompt="two")
    behind = gated.stream(prompt="three")
    admitted(recorder, running)
    assert gated.statistics() == SchedulerStatistics(
        slots=1, running=1, queued=2, queue_size=QUEUE_SIZE, queue_peak=2
    )

    assert queued.cancel() is True
    # The slot is still held by the gate: nothing below waited for it.
    assert queued.end_reason is EndReason.USER_CANCEL
    assert queued.trace.released is not None
    assert queued.trace.admitted is None
    assert queued.trace.first_token is None
    assert queued.usage.completion_tokens == 0
    assert gated.statistics().queued == 1
    assert gated.statistics().running == 1
    assert list(queued) == []  # reading a cancelled stream ends quietly
    assert recorder.kinds(queued.request_id) == [
        "enqueued",
        "cancel_requested",
        "ended",
        "released",
    ]

    assert running.end_reason is None
    assert behind.end_reason is None
    gate.set()
    assert "".join(running) == "abc"
    assert "".join(behind) == "abc"
    for stream in (running, behind):
        assert stream.end_reason is EndReason.STOP
        assert stream.wait_released(NET)
        assert stream.trace.cancel_requested is None
    assert behind.trace.admitted is not None
    assert running.trace.last_token is not None
    assert behind.trace.admitted > running.trace.last_token  # FIFO, one slot
    assert gated.statistics() == SchedulerStatistics(
        slots=1, running=0, queued=0, queue_size=QUEUE_SIZE, queue_peak=2
    )


def test_a_full_queue_rejects_at_once(
    gated: Model, gate: threading.Event, recorder: Recorder
) -> None:
    running = gated.stream(prompt="one")
    queued = [gated.stream(prompt="two"), gated.stream(prompt="three")]
    admitted(recorder, running)
    before = gated.statistics()

    with pytest.raises(QueueFull, match="full"):
        gated.stream(prompt="four")

    # It returned while the slot is still held: the caller never waited for room.
    assert gated.statistics() == before
    rejected = recorder.of_kind("enqueued")[-1].request_id
    assert rejected not in {running.request_id, *(s.request_id for s in queued)}
    assert recorder.kinds(rejected) == ["enqueued", "cancel_requested", "ended", "released"]
    ended = next(s for s in recorder.of(rejected) if s.kind == "ended")
    assert ended.end_reason is EndReason.REJECTED
    assert ended.completion_tokens == 0

    gate.set()
    for stream in (running, *queued):
        assert "".join(stream) == "abc"
        assert stream.end_reason is EndReason.STOP


def test_first_token_deadline_of_a_queued_request_counts_from_enqueue(
    gated: Model, gate: threading.Event, recorder: Recorder
) -> None:
    running = gated.stream(prompt="one")
    admitted(recorder, running)
    limit = 0.2
    waiting = gated.stream(prompt="two", limits=Limits(first_token=limit))
    assert gated.statistics().queued == 1

    # The reader waits; the deadline passes while the request is still queued.
    assert list(waiting) == []
    assert waiting.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
    trace = waiting.trace
    assert trace.admitted is None
    assert trace.released is not None
    assert trace.enqueued is not None
    assert trace.cancel_requested is not None
    # Deadlines are taken a hair before the enqueue mark: allow that much.
    assert trace.cancel_requested - trace.enqueued >= limit - 0.01
    assert gated.statistics().queued == 0
    assert running.end_reason is None

    gate.set()
    assert "".join(running) == "abc"
    assert running.end_reason is EndReason.STOP


def test_close_while_streaming_and_queued_releases_everything_with_shutdown(
    runtime: Runtime, recorder: Recorder
) -> None:
    # Long, interruptible steps: the running request is mid-generation when close() comes.
    # Engines from a factory, so the keep-alive is armed: closing must not leave its timer.
    model = runtime.add_engines("slow", lambda: [ScriptedEngine(words(10_000), delay=0.005)])
    assert model.keep_alive is not None
    streaming = model.stream(prompt="one", capacity=2)
    queued = [model.stream(prompt="two"), model.stream(prompt="three")]
    pieces = iter(streaming)
    first = next(pieces)
    assert first == " w0"
    # Now the reader stops; a second reader blocks on a queued request.
    blocked: list[str] = []
    reader = threading.Thread(target=lambda: blocked.extend(queued[0]), name="test-reader")
    reader.start()

    runtime.close()

    reader.join(NET)
    assert not reader.is_alive()
    assert blocked == []
    assert list(pieces) == []
    for stream in (streaming, *queued):
        assert stream.end_reason is EndReason.SHUTDOWN
        assert stream.trace.released is not None
        assert recorder.kinds(stream.request_id)[-1] == "released"
    assert streaming.trace.admitted is not None
    assert all(s.trace.admitted is None for s in queued)
    assert model.state is ModelState.CLOSED
    with pytest.raises(RuntimeClosed):
        model.stream(prompt="after")
    with pytest.raises(RuntimeClosed):
        runtime.add_engines("late", [ScriptedEngine(["x"])])


def test_each_slot_serves_one_request_side_by_side(recorder: Recorder) -> None:
    gates = [threading.Event(), threading.Event()]
    rt = Runtime(slots=2, queue_size=1, keep_alive=None, observers=[recorder])
    try:
        model = rt.add_engines("pair", [ScriptedEngine(["x"], delay=0, gate=g) for g in gates])
        one, two = model.stream(prompt="a"), model.stream(prompt="b")
        admitted(recorder, one)
        admitted(recorder, two)
        assert model.statistics().running == 2
        third = model.stream(prompt="c")
        assert model.statistics().queued == 1
        for g in gates:
            g.set()
        assert ["".join(s) for s in (one, two, third)] == ["x", "x", "x"]
    finally:
        for g in gates:
            g.set()
        rt.close()


def test_a_queued_request_cancelled_as_its_slot_frees_is_still_released(
    runtime: Runtime, gate: threading.Event, recorder: Recorder
) -> None:
    """The cancel lands while the slot is handed on: whichever side wins, the release comes.

    An observer holds the cancelling thread between the cancel and the queue's own
    cancel callback, while the running request finishes and the scheduler looks at the
    queue; then it lets the cancel go on.
    """
    model = runtime.add_engines("gated", [ScriptedEngine(["a"], delay=0, gate=gate)])
    running = model.stream(prompt="one")
    admitted(recorder, running)
    queued = model.stream(prompt="two")
    in_window, go_on = threading.Event(), threading.Event()

    def hold(event: TraceEvent) -> None:
        if event.trace.request_id == queued.request_id and event.kind == "ended":
            in_window.set()
            go_on.wait(NET)

    queued.trace.subscribe(hold)
    canceller = threading.Thread(target=queued.cancel, name="test-canceller")
    canceller.start()
    try:
        assert in_window.wait(NET)
        gate.set()  # the running request ends; its slot is handed on (or freed)
        assert "".join(running) == "a"
        assert running.wait_released(NET)
        assert model.statistics().running == 0
    finally:
        go_on.set()
        canceller.join(NET)
    assert queued.end_reason is EndReason.USER_CANCEL
    assert queued.wait_released(NET)
    assert queued.trace.admitted is None
