"""Each deadline ends a request with its own reason, and the slot is released.

A scripted engine makes each phase as long as the test needs: a prefill that never
ends on its own (``prefill_delay``), steps that never end (``delay``) or a step that
waits on a ``gate`` (a native step that cannot see the cancel until it returns).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tokenbelt import EndReason, Limits, Model, Runtime, ScriptedEngine

from . import NET, Recorder, words

#: a step longer than any test may take: only a cancel can cut it short
LONG = 120.0


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def runtime(recorder: Recorder) -> Iterator[Runtime]:
    rt = Runtime(keep_alive=None, observers=[recorder])
    try:
        yield rt
    finally:
        rt.close()


def test_first_token_deadline_lands_inside_a_long_prefill(
    runtime: Runtime, recorder: Recorder
) -> None:
    model = runtime.add_engines("prefill", [ScriptedEngine(["never"], prefill_delay=LONG)])
    stream = model.stream(prompt="hi", limits=Limits(first_token=0.1))
    recorder.wait(stream.request_id, "admitted")

    assert list(stream) == []
    assert stream.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
    assert stream.wait_released(NET)
    trace = stream.trace
    assert trace.first_token is None
    assert trace.completion_tokens == 0
    assert trace.cancel_requested is not None
    assert trace.enqueued is not None
    assert trace.cancel_requested - trace.enqueued >= 0.1 - 0.01
    assert stream.reply().finish_reason == "length"


def test_total_deadline_ends_a_long_generation(runtime: Runtime, recorder: Recorder) -> None:
    model = runtime.add_engines("endless", [ScriptedEngine(words(100_000), delay=0.002)])
    limit = 0.3
    stream = model.stream(prompt="hi", limits=Limits(total=limit, first_token=NET))

    pieces = list(stream)

    assert stream.end_reason is EndReason.TOTAL_TIMEOUT
    assert pieces  # it was generating when the deadline passed
    assert stream.wait_released(NET)
    trace = stream.trace
    assert trace.enqueued is not None
    assert trace.cancel_requested is not None
    assert trace.cancel_requested - trace.enqueued >= limit - 0.01
    at_cancel = next(s for s in recorder.of(stream.request_id) if s.kind == "cancel_requested")
    assert trace.completion_tokens - at_cancel.completion_tokens <= 1


def test_stall_deadline_ends_a_stuck_step_and_release_waits_for_it(runtime: Runtime) -> None:
    gate = threading.Event()
    gate.set()
    model = runtime.add_engines("stuck", [ScriptedEngine(words(1000), delay=0, gate=gate)])
    stream = model.stream(prompt="hi", capacity=1, limits=Limits(stall=0.3))
    pieces = iter(stream)
    try:
        assert next(pieces) == " w0"
        gate.clear()  # the next step (or the one after it) never returns on its own
        rest = list(pieces)
        assert len(rest) <= 2
        assert stream.end_reason is EndReason.STALL_TIMEOUT
        assert stream.trace.first_token is not None
        # The stuck step cannot see the cancel: the slot is held until it returns.
        assert stream.trace.released is None
        assert model.statistics().running == 1
    finally:
        gate.set()
    assert stream.wait_released(NET)
    assert model.statistics().running == 0
    assert stream.reply().finish_reason == "length"


def test_stall_deadline_starts_at_the_first_token(runtime: Runtime) -> None:
    # A prefill longer than the stall limit is first_token's to bound, not stall's.
    model = runtime.add_engines("prefill", [ScriptedEngine(["a", "b"], prefill_delay=0.5)])
    stream = model.stream(prompt="hi", limits=Limits(stall=0.1))
    assert list(stream) == ["a", "b"]
    assert stream.end_reason is EndReason.STOP
    assert stream.wait_released(NET)


def test_limits_given_to_the_runtime_apply_to_every_request() -> None:
    rt = Runtime(keep_alive=None, limits=Limits(first_token=0.1))
    try:
        model: Model = rt.add_engines("slow", [ScriptedEngine(["x"], prefill_delay=LONG)])
        stream = model.stream(prompt="hi")
        assert list(stream) == []
        assert stream.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
        # A per-request Limits replaces the runtime's.
        fast = rt.add_engines("fast", [ScriptedEngine(["x"], prefill_delay=0.3)])
        ok = fast.stream(prompt="hi", limits=Limits(first_token=NET))
        assert list(ok) == ["x"]
        assert ok.end_reason is EndReason.STOP
    finally:
        rt.close()


@pytest.mark.anyio
async def test_deadline_ends_an_async_reader_too(runtime: Runtime) -> None:
    model = runtime.add_engines("prefill", [ScriptedEngine(["never"], prefill_delay=LONG)])
    stream = model.stream(prompt="hi", limits=Limits(first_token=0.1))
    assert [p async for p in stream] == []
    assert stream.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
    assert await stream.await_released(NET)
