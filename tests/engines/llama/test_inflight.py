"""The stop rule of the batch engine's step in flight, without a model: which stop
aborts the step at once, which waits for the stop watch, and which lets it end.

The flag is the native-readable buffer llama.cpp's abort hook reads (``b"\\x01"``
aborts). Where the stop watch must act, the test stops the sequence before starting the
watch thread, so "not at once" is a state, not a race; waits poll with a safety net.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tokenbelt import GenerationRequest
from tokenbelt.belt import Belt
from tokenbelt.engines.llama._inflight import StepInFlight
from tokenbelt.engines.llama._sequence import Sequence

NET = 5.0  # safety net for every wait, never the assertion
SMALL = 0.01  # a stop_abort_after the stop watch reaches within the test
LONG = 30.0  # a stop_abort_after no test reaches


def make_seq(seq_id: int, *, decoding: bool = True) -> Sequence:
    """An admitted sequence on its own belt: decoding (a token sampled), or with its
    prompt still being read."""
    belt: Belt[str] = Belt(4)
    seq = Sequence(GenerationRequest(prompt="p"), belt.producer, lambda: None)
    seq.set_prompt([1, 2, 3, 4], 4096)
    seq.id = seq_id
    if decoding:
        seq.n_past = 4
        assert seq.accept(5, b"x", end=False).end is None
    assert seq.decoding is decoding
    return seq


def stop(step: StepInFlight, seq: Sequence) -> None:
    """What a cancelling thread does: mark the sequence, then apply the rule."""
    seq.cancelled = True
    step.stop(seq)


def aborted(step: StepInFlight) -> bool:
    raw = step.flag.raw
    assert raw[0:1] in (b"\x00", b"\x01")
    assert raw[1:2] == b"\x00"  # the native hook reads a C string: strlen != 0 aborts
    return step.flag.value == b"\x01"


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + NET
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        time.sleep(0.001)


def watch_idle(step: StepInFlight) -> bool:
    """True when the stop watch sleeps with nothing armed: an untimed wait in its loop."""
    frame = sys._current_frames().get(step.thread.ident or -1)
    if frame is None or frame.f_code.co_name != "wait":
        return False
    if frame.f_code.co_filename != threading.__file__ or frame.f_locals.get("timeout") is not None:
        return False
    caller = frame.f_back
    return caller is not None and caller.f_code.co_name == "_watch_stops"


@pytest.fixture
def steps() -> Iterator[Callable[[float], StepInFlight]]:
    """``steps(stop_abort_after)``: a StepInFlight, its watch closed after the test."""
    made: list[StepInFlight] = []

    def make(stop_abort_after: float) -> StepInFlight:
        step = StepInFlight("test", stop_abort_after)
        made.append(step)
        return step

    yield make
    for step in made:
        step.close()


def test_begin_clears_the_flag_and_end_leaves_no_step(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(LONG)
    step.start()
    a = make_seq(0)
    assert not step.running
    step.abort()
    assert aborted(step)
    step.begin([a], 0.0)
    assert not aborted(step)
    assert step.running
    step.end()
    assert not step.running
    step.stop(a)  # no step in flight: the loop leaves it out of the next one
    assert not aborted(step)


def test_every_sequence_stopped_aborts_at_once(steps: Callable[[float], StepInFlight]) -> None:
    step = steps(LONG)
    step.start()
    a, b = make_seq(0), make_seq(1)
    step.begin([a, b], 0.0)
    stop(step, a)
    assert not aborted(step)  # b's token is worth finishing
    stop(step, b)
    assert aborted(step)
    assert step.escalated == 0  # nothing was lost that a wait would have kept


def test_a_lone_stopped_sequence_aborts_at_once(steps: Callable[[float], StepInFlight]) -> None:
    step = steps(LONG)
    step.start()
    a = make_seq(0)
    step.begin([a], 0.0)
    stop(step, a)
    assert aborted(step)
    assert step.escalated == 0


def test_a_stopped_sequence_whose_prompt_is_in_the_step_aborts_at_once(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(LONG)
    step.start()
    running, reading = make_seq(0), make_seq(1, decoding=False)
    step.begin([running, reading], 0.0)
    stop(step, reading)
    assert aborted(step)
    assert step.escalated == 0


def test_a_step_already_carrying_a_stopped_prompt_aborts_at_begin(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(LONG)
    step.start()
    running, reading = make_seq(0), make_seq(1, decoding=False)
    reading.cancelled = True  # stopped between the plan and the step
    step.begin([running, reading], 0.0)
    assert aborted(step)


def test_a_stop_beside_a_running_stream_lets_a_short_step_end(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(LONG)
    step.start()
    a, b = make_seq(0), make_seq(1)
    step.begin([a, b], 0.001)
    stop(step, a)
    assert not aborted(step)
    assert step.escalated == 0
    step.end()
    assert not aborted(step)
    # The next step does not carry the stopped sequence: nothing to abort.
    step.begin([b], 0.001)
    assert not aborted(step)


def test_the_stop_watch_aborts_a_step_still_running_after_stop_abort_after(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(SMALL)
    a, b = make_seq(0), make_seq(1)
    step.begin([a, b], 0.0)  # expected to end at once: the rule waits
    stopped_at = time.monotonic()
    stop(step, a)
    assert not aborted(step)  # not at once (and no watch is running yet)
    step.start()
    wait_for(lambda: aborted(step), "the stop watch aborts the step")
    assert time.monotonic() - stopped_at >= SMALL
    assert step.escalated == 1
    wait_for(lambda: watch_idle(step), "the stop watch goes idle")
    assert step.escalated == 1  # once


def test_a_step_stopped_in_a_running_begin_is_watched(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(SMALL)
    step.start()
    wait_for(lambda: watch_idle(step), "the stop watch starts idle")
    a, b = make_seq(0), make_seq(1)
    a.cancelled = True
    begun = time.monotonic()
    step.begin([a, b], 0.0)
    wait_for(lambda: aborted(step), "the stop watch aborts the step")
    assert time.monotonic() - begun >= SMALL
    assert step.escalated == 1


def test_end_disarms_the_stop_watch(steps: Callable[[float], StepInFlight]) -> None:
    step = steps(SMALL)
    a, b = make_seq(0), make_seq(1)
    step.begin([a, b], 0.0)
    stopped_at = time.monotonic()
    stop(step, a)
    step.end()  # the step ended in time
    step.start()
    wait_for(lambda: time.monotonic() - stopped_at > 2 * SMALL, "the stop's bound passes")
    wait_for(lambda: watch_idle(step), "the stop watch goes idle")
    assert not aborted(step)
    assert step.escalated == 0
    # The next step is not aborted for the old stop either.
    step.begin([b], 0.0)
    assert not aborted(step)
    assert step.escalated == 0


def test_a_step_expected_to_run_past_the_bound_aborts_at_once_and_counts(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(SMALL)
    step.start()
    a, b, c = make_seq(0), make_seq(1), make_seq(2)
    step.begin([a, b, c], 5.0)
    stop(step, a)
    assert aborted(step)
    assert step.escalated == 1
    stop(step, b)  # already aborted: counted once
    assert step.escalated == 1
    step.end()
    step.begin([c], 5.0)  # the counter is the engine's total
    assert not aborted(step)
    stop(step, c)
    assert aborted(step)
    assert step.escalated == 1  # all stopped: at once, not an escalation


def test_abort_if_alone_aborts_only_a_step_of_that_sequence_alone(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(LONG)
    step.start()
    a, b = make_seq(0), make_seq(1)
    step.abort_if_alone(a)  # no step in flight
    assert not aborted(step)
    step.begin([a, b], 0.0)
    step.abort_if_alone(a)  # shared: it runs on, so no one else pays
    assert not aborted(step)
    step.end()
    step.begin([b], 0.0)
    step.abort_if_alone(a)
    assert not aborted(step)
    step.end()
    step.begin([a], 0.0)
    step.abort_if_alone(a)
    assert aborted(step)
    assert step.escalated == 0


def test_abort_holds_until_the_next_begin(steps: Callable[[float], StepInFlight]) -> None:
    step = steps(LONG)
    a = make_seq(0)
    step.begin([a], 0.0)
    step.abort()
    assert aborted(step)
    step.end()
    assert aborted(step)  # every later step too, until the loop begins one
    step.begin([a], 0.0)
    assert not aborted(step)


def test_close_ends_the_stop_watch_even_while_armed(
    steps: Callable[[float], StepInFlight],
) -> None:
    step = steps(LONG)
    step.start()
    a, b = make_seq(0), make_seq(1)
    step.begin([a, b], 0.0)
    stop(step, a)  # armed for LONG seconds
    started = time.monotonic()
    step.close()
    assert not step.thread.is_alive()
    assert time.monotonic() - started < NET
    assert not aborted(step)
    step.close()  # idempotent


def test_close_without_start_is_harmless(steps: Callable[[float], StepInFlight]) -> None:
    step = steps(SMALL)
    step.close()
    assert not step.thread.is_alive()
