"""The decode runs nicer than the threads that deliver its tokens (``decode_nice``).

Read from /proc: each thread's niceness, before and after an engine loads and decodes.
The engine thread lowers itself before its first step, so the threads llama.cpp's
OpenMP runtime starts from it are as nice; the threads that take a stop (the stop
watcher, a worker's main thread) and every thread of the caller keep their priority.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

from niceness import niceness
from tokenbelt import GenerationRequest, InvalidArgument, SamplingParams
from tokenbelt.belt import Belt
from tokenbelt.engines import BatchEngine, WorkerEngine
from tokenbelt.models import default_model_path

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(sys.platform != "linux", reason="a thread's own niceness is Linux's"),
]

NET = 60.0


def decode_a_few(engine: BatchEngine | WorkerEngine) -> None:
    belt: Belt[str] = Belt(64)
    belt.trace.mark_enqueued()
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.start(GenerationRequest(prompt="The sea is", sampling=sampling), belt.producer)
    assert "".join(belt)
    assert belt.wait_released(NET)


def test_the_engine_thread_and_llama_cpps_threads_run_nicer_the_rest_do_not() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = niceness(os.getpid())
    engine = BatchEngine(
        default_model_path(), slots=1, n_ctx=256, n_threads=2, n_threads_batch=2, decode_nice=7
    )
    try:
        decode_a_few(engine)
        now = niceness(os.getpid())
        new = {tid: nice for tid, nice in now.items() if tid not in before}
        assert engine._thread.native_id is not None
        assert now[engine._thread.native_id] == min(19, base + 7)
        # The stop watcher takes a stop while a step runs: it keeps the caller's priority.
        assert engine._inflight.thread.native_id is not None
        assert now[engine._inflight.thread.native_id] == base
        # The engine thread and the OpenMP thread it started for 2-thread steps.
        lowered = [tid for tid, nice in new.items() if nice == min(19, base + 7)]
        assert len(lowered) >= 2, new
        # Nothing that was here before the load changed, the caller's thread included.
        assert {tid: now[tid] for tid in before if tid in now} == {
            tid: nice for tid, nice in before.items() if tid in now
        }
        assert now[threading.get_native_id()] == base
    finally:
        engine.close()


def test_a_worker_lowers_its_decode_and_keeps_its_reader_of_stops() -> None:
    engine = WorkerEngine(
        default_model_path(), slots=1, n_ctx=256, n_threads=2, n_threads_batch=2, decode_nice=5
    )
    try:
        decode_a_few(engine)
        pid = engine.pid
        assert pid is not None
        threads = niceness(pid)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        # Its main thread reads the parent's stops and credits: the parent's priority.
        assert threads[pid] == base
        assert sum(1 for nice in threads.values() if nice == min(19, base + 5)) >= 2, threads
    finally:
        engine.close()


def test_zero_leaves_every_thread_as_it_was() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    engine = BatchEngine(default_model_path(), slots=1, n_ctx=256, decode_nice=0)
    try:
        decode_a_few(engine)
        assert engine._thread.native_id is not None
        assert niceness(os.getpid())[engine._thread.native_id] == base
    finally:
        engine.close()


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True])
def test_a_niceness_outside_0_to_19_is_refused_before_loading(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="decode_nice must be an integer from 0 to 19"):
        BatchEngine(default_model_path(), decode_nice=bad)  # type: ignore[arg-type]


def test_a_sandbox_that_forbids_it_leaves_the_priority_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed ``setpriority`` (seccomp, a container's policy) must not end the engine's
    loop: the decode keeps the process's priority and the log says why."""
    from tokenbelt.engines.llama import _threads

    def refuse(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(_threads.os, "setpriority", refuse)
    with caplog.at_level("WARNING", logger="tokenbelt.engines.batch"):
        _threads.lower_this_thread(5)
    assert "keep the process's priority: [Errno 1] Operation not permitted" in caplog.text
    assert niceness(os.getpid())[threading.get_native_id()] == os.getpriority(os.PRIO_PROCESS, 0)
