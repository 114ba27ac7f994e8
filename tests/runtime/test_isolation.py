"""The engine in a worker process: crashes end requests, not the service; stops are bounded.

Real parts throughout: the default model, a real worker process per loaded model, real
signals (``SIGKILL``, ``SIGSTOP``, a native ``abort()`` inside ``llama_decode``). Waits
poll a condition under the ``NET`` safety net; the net is never the assertion.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import psutil
import pytest

from tokenbelt import (
    EndReason,
    InvalidArgument,
    Limits,
    LoadTimeout,
    Model,
    Runtime,
    Stream,
    WorkerCrashed,
)
from tokenbelt.engines import ABORT_ENV, GenerationRequest, WorkerEngine, load_vocab
from tokenbelt.models import default_model_path

from . import NET, Recorder, wait_until

pytestmark = pytest.mark.model

GREEDY: dict[str, Any] = {"temperature": 0.0}
SEA = [{"role": "user", "content": "Tell me about the sea."}]
HELLO = [{"role": "user", "content": "Say hello."}]
#: the stop grace of these tests: long enough for a busy machine, short for the suite
GRACE = 1.5

_WORDS = ["the", "sea", "is", "wide", "and", "deep", "blue", "under", "a", "grey", "sky"]


def long_text(words: int) -> str:
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


def engine_of(model: Model) -> WorkerEngine:
    engine = model.engines[0]
    assert isinstance(engine, WorkerEngine)
    return engine


def worker_pid(model: Model) -> int:
    wait_until(lambda: engine_of(model).pid is not None, "a running worker")
    pid = engine_of(model).pid
    assert pid is not None
    return pid


def read_all(stream: Stream) -> threading.Thread:
    def run() -> None:
        for _ in stream:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _process_runtime(recorder: Recorder | None = None, **options: Any) -> Runtime:
    params: dict[str, Any] = {"keep_alive": None, "n_ctx": 2048, "isolation": "process"}
    params.update(options)
    return Runtime(observers=[recorder] if recorder else [], **params)


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def runtime(recorder: Recorder) -> Iterator[Runtime]:
    rt = _process_runtime(recorder, slots=2, stop_grace=GRACE)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture(scope="module")
def model(runtime: Runtime) -> Model:
    return runtime.load(str(default_model_path()))


def _end_tokens() -> dict[int, float]:
    """A logit_bias banning the default model's end-of-generation tokens (its vocabulary's)."""
    vocab = load_vocab(default_model_path())
    try:
        n = llama_cpp.llama_vocab_n_tokens(vocab.vocab)
        return {t: -100.0 for t in range(n) if llama_cpp.llama_vocab_is_eog(vocab.vocab, t)}
    finally:
        vocab.close()


def test_a_reply_through_the_worker_is_the_in_process_reply(model: Model) -> None:
    # The greedy reply to HELLO ends on its own after 22 tokens: with the end tokens
    # banned, both replies run the whole 24 and are compared over all of them.
    no_end = {"logit_bias": _end_tokens(), **GREEDY}
    plain = Runtime(keep_alive=None, n_ctx=2048, prefix_cache=False)
    try:
        here = plain.load(str(default_model_path())).complete(HELLO, max_tokens=24, **no_end)
    finally:
        plain.close()
    there = model.complete(HELLO, max_tokens=24, **no_end)
    assert there.end_reason is EndReason.LENGTH
    assert there.text == here.text
    trace = there.trace
    assert trace.completion_tokens == 24
    assert trace.prompt_tokens > 0
    assert trace.worker is not None
    assert trace.worker["pid"] == engine_of(model).pid
    assert model.info["isolation"] == "process"
    assert engine_of(model).pid != os.getpid()


def test_the_worker_computes_the_prompt_the_parent_tokenized(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent tokenizes each prompt once (to admit it) and sends the tokens along:
    the worker computes those tokens and does not template the request again. Here the
    parent's tokens are another prompt's, so the reply is that prompt's reply."""
    engine = engine_of(model)
    expected = model.complete(HELLO, max_tokens=12, **GREEDY)
    hello_tokens = engine.tokenize_request(GenerationRequest(messages=tuple(HELLO)))
    # where the parent makes every prompt's tokens
    monkeypatch.setattr(engine._prompts, "tokenize", lambda request: list(hello_tokens))
    reply = model.complete(SEA, max_tokens=12, **GREEDY)
    assert reply.trace.prompt_tokens == len(hello_tokens)
    assert reply.text == expected.text


def test_grammar_and_logprobs_cross_the_boundary_and_bad_ones_stop_before_it(
    model: Model,
) -> None:
    """Items richer than text (logprobs) come back whole; a grammar constrains the worker's
    sampling; what the vocabulary refuses is refused here, before the worker sees it."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    pid = worker_pid(model)
    shaped = model.complete(
        [{"role": "user", "content": "A person as JSON."}], schema=schema, max_tokens=64, **GREEDY
    )
    assert shaped.end_reason is EndReason.STOP
    assert isinstance(shaped.parsed, dict)
    assert set(shaped.parsed) == {"name", "age"}
    assert isinstance(shaped.parsed["age"], int)
    scored = model.complete(HELLO, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
    assert len(scored.logprobs) == scored.trace.completion_tokens == 6
    assert "".join(t.token for t in scored.logprobs) == scored.text
    assert all(t.logprob <= 0 and len(t.top) == 2 for t in scored.logprobs)
    with pytest.raises(InvalidArgument, match="logit_bias"):
        model.stream(HELLO, max_tokens=4, logit_bias={10**6: 5.0})
    with pytest.raises(InvalidArgument):
        model.stream(HELLO, max_tokens=4, schema={"type": "string", "format": "no-such-format"})
    assert engine_of(model).pid == pid  # the same worker throughout: nothing crashed it


def test_kill_9_mid_stream_ends_running_and_admitted_requests_and_keeps_the_queue(
    model: Model,
) -> None:
    engine = engine_of(model)
    restarts = engine.worker_statistics().restarts
    running = [model.stream(SEA, max_tokens=400, capacity=4, **GREEDY) for _ in range(2)]
    queued = model.stream(HELLO, max_tokens=8, **GREEDY)  # both slots are busy: it waits
    pieces = iter(running[0])
    got = [next(pieces) for _ in range(3)]
    assert model.statistics().queued == 1
    pid = worker_pid(model)

    os.kill(pid, signal.SIGKILL)

    with pytest.raises(WorkerCrashed, match=r"engine worker killed by signal 9 \(SIGKILL\)"):
        got.extend(pieces)
    for stream in running:
        assert stream.wait_released(NET)
        assert stream.end_reason is EndReason.RUNTIME_ERROR
        assert stream.trace.error is not None
        assert "killed by signal 9" in stream.trace.error
    # The queued request was never the worker's: it waits for the next one, then is served.
    reply = queued.read()
    assert reply.end_reason is EndReason.LENGTH
    assert reply.text
    stats = engine.worker_statistics()
    assert stats.restarts == restarts + 1
    assert stats.last_crash == "engine worker killed by signal 9 (SIGKILL)"
    assert stats.pid is not None
    assert stats.pid != pid
    assert not psutil.pid_exists(pid)
    # And the model goes on serving.
    assert model.complete(HELLO, max_tokens=8, **GREEDY).end_reason is EndReason.LENGTH


def test_a_hung_worker_is_killed_within_the_grace_and_the_stop_released(
    model: Model, recorder: Recorder
) -> None:
    engine = engine_of(model)
    stream = model.stream(SEA, max_tokens=400, capacity=4, **GREEDY)
    pieces = iter(stream)
    next(pieces)
    pid = worker_pid(model)
    os.kill(pid, signal.SIGSTOP)
    try:
        asked = time.monotonic()
        assert stream.cancel()
        # The stop is posted, not sent: the caller (an event loop) never waits on the worker.
        assert time.monotonic() - asked < GRACE / 2
        assert stream.wait_released(GRACE + NET)
    finally:
        if psutil.pid_exists(pid):  # never leave a stopped process behind
            os.kill(pid, signal.SIGKILL)
    trace = stream.trace
    assert stream.end_reason is EndReason.USER_CANCEL  # the stop's reason stays
    assert trace.cancel_to_release is not None
    assert trace.cancel_to_release >= GRACE  # the worker had its grace...
    assert trace.cancel_to_release < GRACE + 10.0  # ...and then no more (a busy-machine net)
    assert trace.worker is not None
    assert trace.worker["pid"] == pid
    assert "a stop was not honoured within 1.5 s" in trace.worker["killed"]
    assert trace.worker["killed_after_stop_ms"] >= GRACE * 1000
    assert trace.release_lagged  # the release-lag alert fired
    assert "release_lag" in recorder.kinds(stream.request_id)
    wait_until(lambda: not psutil.pid_exists(pid), "the hung worker gone")
    assert engine.worker_statistics().last_crash is not None
    assert model.complete(HELLO, max_tokens=8, **GREEDY).end_reason is EndReason.LENGTH


def test_a_paused_reader_holds_the_worker_within_its_capacity(model: Model) -> None:
    paused = model.stream(SEA, max_tokens=300, capacity=4, **GREEDY)
    wait_until(lambda: paused.statistics().buffered == 4, "the belt full")
    # Other work runs meanwhile: had the worker gone on, it would have by now.
    model.complete(HELLO, max_tokens=16, **GREEDY)
    assert paused.trace.completion_tokens <= 4 + 1
    assert paused.statistics().buffered <= 4
    assert paused.end_reason is None
    pieces = iter(paused)
    for _ in range(20):
        next(pieces)
    assert paused.trace.completion_tokens >= 20
    # Reading again resumes it, and still it runs at most a belt ahead of the reader.
    model.complete(HELLO, max_tokens=8, **GREEDY)
    assert paused.trace.completion_tokens <= 20 + 4 + 1
    paused.cancel()
    assert paused.wait_released(NET)


def test_a_deadline_ends_a_stream_nobody_reads_and_the_worker_lets_go(model: Model) -> None:
    stream = model.stream(SEA, max_tokens=400, capacity=2, limits=Limits(total=0.5), **GREEDY)
    assert stream.wait_released(NET)
    assert stream.end_reason is EndReason.TOTAL_TIMEOUT
    assert stream.trace.completion_tokens <= 2 + 1
    assert model.complete(HELLO, max_tokens=4, **GREEDY).end_reason is EndReason.LENGTH


def test_a_load_that_takes_too_long_kills_its_worker() -> None:
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(LoadTimeout):
        WorkerEngine(default_model_path(), n_ctx=512, load_timeout=0.001)
    started = [p for p in psutil.Process().children() if p.pid not in before]
    assert started == []  # killed and reaped


def test_a_stop_during_prefill_reaches_the_worker_within_a_step(
    model: Model, recorder: Recorder
) -> None:
    stream = model.stream(prompt=long_text(1500), max_tokens=16, **GREEDY)
    wait_until(lambda: stream.trace.admitted is not None, "admission of the long prompt")
    assert stream.cancel()
    assert stream.wait_released(NET)
    assert stream.end_reason is EndReason.USER_CANCEL
    assert stream.trace.first_token is None
    assert recorder.wait(stream.request_id, "cancel_requested").completion_tokens == 0
    # The in-process bound (tests/runtime/test_batching.py), plus the pipe both ways.
    assert stream.trace.cancel_to_release is not None
    assert stream.trace.cancel_to_release < 1.0 + 0.25
    assert stream.trace.worker is not None
    assert "killed" not in stream.trace.worker


@pytest.mark.parametrize("point", ["prefill", "decode"])
def test_a_native_abort_in_the_worker_ends_the_request_not_the_service(
    point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ABORT_ENV, point)  # the first worker aborts at this point
    with _process_runtime() as rt:
        model = rt.load(str(default_model_path()))
        stream = model.stream(SEA, max_tokens=64, **GREEDY)
        got: list[str] = []
        with pytest.raises(WorkerCrashed, match=r"killed by signal 6 \(SIGABRT\)"):
            got.extend(stream)
        assert stream.end_reason is EndReason.RUNTIME_ERROR
        assert stream.trace.admitted is not None
        if point == "prefill":
            assert got == []
            assert stream.trace.completion_tokens == 0
        else:
            assert len(got) >= 1
            assert stream.trace.completion_tokens >= 1
        assert engine_of(model).worker_statistics().last_crash == (
            "engine worker killed by signal 6 (SIGABRT)"
        )
        # Only the first worker had the crash point: the restarted one serves.
        assert model.complete(HELLO, max_tokens=8, **GREEDY).end_reason is EndReason.LENGTH
        assert engine_of(model).worker_statistics().restarts == 1


def test_unloading_a_model_ends_its_worker_and_returns_its_memory() -> None:
    with _process_runtime() as rt:
        model = rt.load(str(default_model_path()))
        engine = engine_of(model)
        pid = worker_pid(model)
        rss = engine.worker_statistics().rss_bytes
        assert rss is not None
        assert rss > 50 * 2**20
        assert model.complete(HELLO, max_tokens=4, **GREEDY).end_reason is EndReason.LENGTH
        rt.unload(model.name)
        assert not psutil.pid_exists(pid)  # exited and reaped: all of its memory is back
        stats = engine.worker_statistics()
        assert stats.state == "closed"
        assert stats.pid is None
        assert stats.rss_bytes is None


def test_workers_that_keep_dying_at_load_mark_the_engine_failed(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), path)
    with _process_runtime(keep_alive=None) as rt:
        model = rt.load(str(path))
        engine = engine_of(model)
        pid = worker_pid(model)
        # From now on no worker can load it (the running one keeps its mapping).
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(b"GGUF" + b"\0" * 64)
        os.replace(broken, path)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: engine.failure is not None, "the engine marked failed")
        assert engine.worker_statistics().state == "failed"
        assert engine.failure is not None
        assert "3 times in a row" in engine.failure
        stream = model.stream(HELLO, max_tokens=4, **GREEDY)
        with pytest.raises(WorkerCrashed, match="3 times in a row"):
            stream.read()
        assert stream.end_reason is EndReason.RUNTIME_ERROR
        assert stream.wait_released(NET)
