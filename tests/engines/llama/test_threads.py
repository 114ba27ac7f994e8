"""The thread tuner: it follows the measured step cost, both ways, and explores rarely."""

from __future__ import annotations

import os

import pytest

from tokenbelt import InvalidArgument, Runtime
from tokenbelt.engines.llama._threads import ThreadTuner, embed_kind, thread_candidates


def test_candidates_are_all_cores_one_fewer_and_half() -> None:
    assert thread_candidates(2) == [2, 1]
    assert thread_candidates(1) == [1]
    assert thread_candidates(16) == [16, 15, 8]


def drive(tuner: ThreadTuner, cost: dict[int, float], steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        threads = tuner.choose("decode")
        chosen.append(threads)
        tuner.record("decode", threads, cost[threads], 1)
    return chosen


def test_a_neighbour_taking_a_core_moves_the_tuner_to_fewer_threads_and_back() -> None:
    tuner = ThreadTuner([2, 1], explore_every=8)
    quiet = {2: 0.010, 1: 0.019}  # two threads nearly twice as fast
    busy = {2: 0.200, 1: 0.020}  # a neighbour stalls every barrier of two threads
    drive(tuner, quiet, 100)
    assert tuner.best("decode") == 2
    chosen = drive(tuner, busy, 100)
    assert tuner.best("decode") == 1
    assert chosen[-50:].count(2) <= 2  # explored now and then, not used
    # Back to quiet: one trial of two threads (at most 16 x 8 steps away) is enough.
    drive(tuner, quiet, 8 * 16 + 1)
    assert tuner.best("decode") == 2


def test_one_slow_step_does_not_move_the_tuner_off_the_faster_count() -> None:
    # Close costs, as a lone stream of the default model has them on 2 cores.
    tuner = ThreadTuner([2, 1], explore_every=8)
    close = {2: 0.0062, 1: 0.0070}
    drive(tuner, close, 64)
    assert tuner.best("decode") == 2
    tuner.record("decode", 2, 0.011, 1)  # a page fault, or the event loop took a core
    chosen = drive(tuner, close, 64)
    assert tuner.best("decode") == 2
    assert chosen.count(1) <= 64 // 8  # explored, never chosen


def test_an_untried_count_waits_for_the_first_exploring_turn() -> None:
    tuner = ThreadTuner([2, 1], explore_every=8)
    chosen = drive(tuner, {2: 0.004, 1: 0.007}, 16)
    # The first prompts after a start (a readiness probe, then the first request) run on
    # every core; one thread is tried on the kind's first exploring turn.
    assert chosen[:7] == [2] * 7
    assert chosen[7] == 1
    assert tuner.best("decode") == 2


def test_a_count_within_the_margin_does_not_take_over() -> None:
    tuner = ThreadTuner([2, 1], explore_every=8)
    drive(tuner, {2: 0.0062, 1: 0.0070}, 64)
    chosen = drive(tuner, {2: 0.0070, 1: 0.0068}, 200)  # one thread 3% cheaper: noise
    assert chosen[-100:].count(1) <= 100 // 8 + 1
    chosen = drive(tuner, {2: 0.0070, 1: 0.0060}, 200)  # 14% cheaper: a real change
    assert chosen[-100:].count(2) <= 100 // 8 + 1


def test_exploring_a_much_worse_count_backs_off() -> None:
    tuner = ThreadTuner([2, 1], explore_every=8)
    chosen = drive(tuner, {2: 0.010, 1: 0.030}, 4000)
    assert chosen[-2000:].count(1) <= 2000 // (8 * 16) + 1


def test_each_embedding_size_learns_its_own_count_apart_from_prompt_chunks() -> None:
    tuner = ThreadTuner([2, 1], explore_every=8)
    short, batch = embed_kind(7), embed_kind(246)
    assert len({short, batch, embed_kind(4498), "prefill"}) == 4
    assert embed_kind(3) == short
    assert embed_kind(200) == batch
    # Per-token costs as measured: a single short input is cheaper on one thread,
    # a batch of inputs and a prompt chunk on two.
    cost = {
        short: {2: 0.012, 1: 0.008},
        batch: {2: 0.004, 1: 0.007},
        "prefill": {2: 0.004, 1: 0.007},
    }
    for _ in range(50):
        for kind, by_count in cost.items():
            threads = tuner.choose(kind)
            tuner.record(kind, threads, by_count[threads] * 10, 10)
    assert (tuner.best(short), tuner.best(batch), tuner.best("prefill")) == (1, 2, 2)


def test_a_busy_machine_tries_the_fewest_threads_first() -> None:
    assert thread_candidates(2, load=0.3) == [2, 1]
    assert thread_candidates(2, load=3.5) == [1, 2]


def test_thread_counts_beyond_what_the_machine_can_start_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="from 1 to"):
        Runtime(n_threads=4 * (os.cpu_count() or 1) + 1)
    with pytest.raises(InvalidArgument, match="from 1 to"):
        Runtime(n_threads_batch=0)
