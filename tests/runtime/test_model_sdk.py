"""The SDK on the real default model: backpressure, stops, deadlines, usage, observers.

One runtime and one loaded model serve the whole module. "Tokens computed" is
``trace.completion_tokens`` (the engine counts a token as soon as it is sampled, before
it reaches the belt); "tokens read" is the belt's ``consumed`` count. A ``Recorder``
subscribed on the runtime captures tokens computed at the moment each cancel was
requested.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tokenbelt import (
    EndReason,
    GenerationRequest,
    InvalidArgument,
    Limits,
    Model,
    Runtime,
    Stream,
)
from tokenbelt.engines import BatchEngine, Message
from tokenbelt.models import default_model_path

from . import NET, TIMELINE, Recorder, await_until, wait_until

pytestmark = pytest.mark.model

#: greedy and long-winded: no end of generation within 64 tokens on the default model
SEA: list[Message] = [{"role": "user", "content": "Tell me about the sea."}]
#: greedy, and ends on its own (end of generation) after about twenty tokens
HELLO: list[Message] = [{"role": "user", "content": "Say hello."}]
GREEDY: dict[str, Any] = {"temperature": 0.0}


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def runtime(recorder: Recorder) -> Iterator[Runtime]:
    # No keep-alive: its timer thread would outlive each test that ends a request.
    rt = Runtime(keep_alive=None, n_ctx=2048, observers=[recorder])
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture(scope="module")
def model(runtime: Runtime) -> Model:
    return runtime.load(str(default_model_path()), load_timeout=120)


def computed_minus_read(stream: Stream) -> int:
    computed = stream.trace.completion_tokens  # first: reads only ever move it down
    return computed - stream.statistics().consumed


def assert_stopped(stream: Stream, recorder: Recorder, max_tokens: int) -> None:
    """user_cancel, released, at most one token after the cancel, a full timeline."""
    assert stream.end_reason is EndReason.USER_CANCEL
    assert stream.wait_released(NET)
    trace = stream.trace
    at_cancel = recorder.wait(stream.request_id, "cancel_requested")
    after = trace.completion_tokens - at_cancel.completion_tokens
    assert after <= 1, f"{after} tokens were computed after the cancel"
    assert trace.completion_tokens < max_tokens
    missing = [name for name in TIMELINE if getattr(trace, name) is None]
    assert not missing, f"the trace lacks {missing}"
    assert trace.enqueued <= trace.admitted <= trace.first_token <= trace.last_token  # type: ignore[operator]
    assert trace.cancel_requested <= trace.released  # type: ignore[operator]
    assert trace.cancel_to_release is not None
    assert stream.reply().finish_reason == "stop"


# -- backpressure ------------------------------------------------------------------------------


def test_a_slow_reader_holds_generation_within_capacity(model: Model) -> None:
    capacity, max_tokens = 1, 16
    stream = model.stream(SEA, capacity=capacity, max_tokens=max_tokens, **GREEDY)
    worst = 0

    def observe() -> bool:
        nonlocal worst
        ahead = computed_minus_read(stream)
        assert ahead <= capacity + 1, f"generation ran {ahead} tokens ahead of the reader"
        worst = max(worst, ahead)
        return True

    def parked() -> bool:
        # The slowest reader: it takes a piece only once generation waits on a full belt.
        return observe() and (
            stream.statistics().buffered >= capacity or stream.end_reason is not None
        )

    pieces = iter(stream)
    while True:
        wait_until(parked, "a full belt")
        if next(pieces, None) is None:
            break
        observe()

    assert stream.end_reason is EndReason.LENGTH
    assert stream.trace.completion_tokens == max_tokens
    assert stream.usage.completion_tokens == max_tokens
    assert stream.trace.buffer_peak == capacity
    assert worst >= capacity  # the reader really was the slow side


@pytest.mark.anyio
async def test_a_slow_async_reader_holds_generation_within_capacity(model: Model) -> None:
    capacity, max_tokens = 4, 20
    stream = model.stream(SEA, capacity=capacity, max_tokens=max_tokens, **GREEDY)

    def parked() -> bool:
        assert computed_minus_read(stream) <= capacity + 1
        return stream.statistics().buffered >= capacity or stream.end_reason is not None

    pieces = aiter(stream)
    while True:
        await await_until(parked, "a full belt")
        if await anext(pieces, None) is None:
            break
        assert computed_minus_read(stream) <= capacity + 1

    assert stream.end_reason is EndReason.LENGTH
    assert stream.trace.completion_tokens == max_tokens
    assert stream.trace.buffer_peak == capacity


# -- stopping after five pieces ----------------------------------------------------------------

LONG = 256


def test_break_after_five_pieces(model: Model, recorder: Recorder) -> None:
    stream = model.stream(SEA, max_tokens=LONG, **GREEDY)
    read = 0
    for _ in stream:
        read += 1
        if read == 5:
            break
    assert read == 5
    assert_stopped(stream, recorder, LONG)


@pytest.mark.anyio
async def test_async_cancel_after_five_pieces(model: Model, recorder: Recorder) -> None:
    stream = model.stream(SEA, max_tokens=LONG, **GREEDY)
    read = 0
    async for _ in stream:
        read += 1
        if read == 5:
            assert stream.cancel() is True
            assert stream.cancel() is False  # idempotent: the first call decided
    assert read == 5  # the loop ended quietly, with nothing read after the cancel
    assert await stream.await_released(NET)
    assert_stopped(stream, recorder, LONG)


def test_cancel_from_another_thread_after_five_pieces(model: Model, recorder: Recorder) -> None:
    stream = model.stream(SEA, max_tokens=LONG, **GREEDY)
    pieces = iter(stream)
    read = [next(pieces) for _ in range(5)]
    canceller = threading.Thread(target=stream.cancel, name="test-canceller")
    canceller.start()
    canceller.join(NET)
    read.extend(pieces)  # ends quietly: what was buffered was dropped with the cancel
    assert len(read) == 5
    assert_stopped(stream, recorder, LONG)


# -- deadlines on the real model ---------------------------------------------------------------


def test_total_deadline_during_a_long_generation(model: Model, recorder: Recorder) -> None:
    stream = model.stream(SEA, max_tokens=1024, limits=Limits(total=0.5), **GREEDY)
    pieces = list(stream)
    assert stream.end_reason is EndReason.TOTAL_TIMEOUT
    assert stream.wait_released(NET)
    trace = stream.trace
    at_cancel = recorder.wait(stream.request_id, "cancel_requested")
    assert trace.completion_tokens - at_cancel.completion_tokens <= 1
    assert len(pieces) <= trace.completion_tokens < 1024
    assert stream.reply().finish_reason == "length"


def test_first_token_deadline_inside_a_long_prefill(model: Model) -> None:
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    stream = model.stream(prompt=text, max_tokens=8, limits=Limits(first_token=0.05))
    assert stream.usage.prompt_tokens > 600  # several prefill chunks: far past 50 ms here
    assert list(stream) == []
    assert stream.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
    assert stream.wait_released(NET)
    assert stream.trace.first_token is None
    assert stream.trace.completion_tokens == 0


# -- usage, sampling, observers ----------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": -1},
        {"temperature": "hot"},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 2},
        {"max_tokens": 0},
        {"max_tokens": 2.5},
        {"seed": -1},
        {"stop": [""]},
        {"repeat_penalty": 0},
        {"temprature": 0.5},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_bad_sampling_values_are_rejected_before_any_request(
    model: Model, recorder: Recorder, sampling: dict[str, Any]
) -> None:
    before = len(recorder.seen)
    with pytest.raises(InvalidArgument):
        model.stream(SEA, **sampling)
    with model.chat() as chat, pytest.raises(InvalidArgument):
        chat.send("hi", **sampling)
    assert len(recorder.seen) == before  # nothing was even enqueued


def test_sampling_uses_openai_names(model: Model) -> None:
    kwargs = {"temperature": 1.2, "top_p": 0.9, "seed": 42, "max_tokens": 8}
    engine = model.engines[0]
    assert isinstance(engine, BatchEngine)
    engine.clear_prefix_cache()  # computed cold both times: the same arithmetic
    first = model.complete(SEA, **kwargs)
    engine.clear_prefix_cache()
    again = model.complete(SEA, **kwargs)
    assert first.text == again.text  # the same seed gives the same text
    assert first.end_reason is EndReason.LENGTH
    assert first.finish_reason == "length"
    assert first.usage.completion_tokens == 8


def test_the_repeat_penalty_looks_at_the_last_repeat_last_n_tokens(model: Model) -> None:
    """Ollama's ``repeat_last_n``: 0 turns the penalty off (the unpenalized text), a window
    or the whole context (-1) penalizes what it holds."""
    engine = model.engines[0]
    assert isinstance(engine, BatchEngine)
    prompt = "sea, sea, sea, sea, sea, sea, sea, sea, sea, sea,"  # a text that repeats

    def text(**sampling: Any) -> str:
        engine.clear_prefix_cache()  # computed cold each time: the same arithmetic
        return model.complete(prompt=prompt, max_tokens=24, temperature=0.0, **sampling).text

    plain = text()
    assert text(repeat_penalty=1.8, repeat_last_n=0) == plain
    assert text(repeat_penalty=1.8, repeat_last_n=64) != plain
    assert text(repeat_penalty=1.8, repeat_last_n=-1) != plain
    with pytest.raises(InvalidArgument, match="repeat_last_n must be"):
        model.complete(prompt=prompt, repeat_last_n=-2)


def test_runtime_observers_receive_every_event_in_order(model: Model, recorder: Recorder) -> None:
    done = model.stream(HELLO, max_tokens=64, **GREEDY)
    assert "".join(done)
    assert done.end_reason is EndReason.STOP  # the model's own end of generation
    assert done.wait_released(NET)
    request = GenerationRequest.chat(HELLO)
    usage = done.usage
    assert usage.prompt_tokens == model.engines[0].count_prompt_tokens(request)
    assert 0 < usage.completion_tokens < 64
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert recorder.kinds(done.request_id) == [
        "enqueued",
        "admitted",
        "first_token",
        "ended",
        "released",
    ]

    stopped = model.stream(SEA, max_tokens=LONG, **GREEDY)
    for _ in stopped:
        break
    assert stopped.wait_released(NET)
    assert recorder.kinds(stopped.request_id) == [
        "enqueued",
        "admitted",
        "first_token",
        "cancel_requested",
        "ended",
        "released",
    ]
    ended = [s for s in recorder.of(stopped.request_id) if s.kind == "ended"]
    assert ended[0].end_reason is EndReason.USER_CANCEL


# -- conversations -----------------------------------------------------------------------------


def test_conversation_after_completed_and_cancelled_turns(model: Model) -> None:
    with model.chat(system="You are terse.", max_tokens=48, **GREEDY) as chat:
        first = chat.send("Say hello.")
        assert first.text
        assert chat.history[1:] == [
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": first.text},
        ]

        cancelled = chat.stream("Tell me about the sea.", max_tokens=LONG)
        for _ in cancelled:
            break
        assert cancelled.end_reason is EndReason.USER_CANCEL
        assert len(chat.history) == 3

        history = chat.history
        second = chat.send("Say goodbye.")
        # The engine was sent the first turn and the new message, not the cancelled turn.
        sent = GenerationRequest.chat([*history, {"role": "user", "content": "Say goodbye."}])
        assert second.usage.prompt_tokens == model.engines[0].count_prompt_tokens(sent)
        assert [m["role"] for m in chat.history] == [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
        ]
        assert chat.undo()[0]["content"] == "Say goodbye."
        assert len(chat.history) == 3


@pytest.mark.anyio
async def test_the_async_session_of_the_readme(model: Model) -> None:
    async with model.achat(system="You are terse.") as chat:
        stream = chat.astream(
            "Tell me about the sea.",
            limits=Limits(first_token=NET, total=NET),
            capacity=8,
            max_tokens=16,
            temperature=0,
        )
        text = "".join([piece async for piece in stream])
        stream.cancel()  # after a natural end: a no-op
    assert text
    assert stream.end_reason is EndReason.LENGTH
    assert await stream.await_released(NET)
    trace = stream.trace.to_dict()
    assert trace["completion_tokens"] == 16
    assert trace["buffer_peak"] <= 8
    assert trace["end_reason"] == "length"
    assert trace["timeline_ms"]["released"] is not None


# -- memory ------------------------------------------------------------------------------------


def test_unload_and_close_return_the_model_memory() -> None:
    """RSS drops by most of the model (about 98 MB of weights, mmap'd, plus its context)."""
    process = psutil.Process()
    rt = Runtime(keep_alive=None, n_ctx=2048)
    try:
        model = rt.load(str(default_model_path()), load_timeout=120)
        loaded = process.memory_info().rss
        rt.unload(model.name)
        gc.collect()
        unloaded = process.memory_info().rss
        rt.load(str(default_model_path()), load_timeout=120)
        reloaded = process.memory_info().rss
    finally:
        rt.close()
    gc.collect()
    closed = process.memory_info().rss
    mb = 1 << 20
    assert loaded - unloaded > 64 * mb, f"unload returned {(loaded - unloaded) / mb:.0f} MB"
    assert reloaded - closed > 64 * mb, f"close returned {(reloaded - closed) / mb:.0f} MB"
