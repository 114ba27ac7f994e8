"""Many streams on one model: batched in one context, each still bounded, stoppable, timed.

One runtime with four slots (four sequences of one llama.cpp context) serves the
module. "Tokens computed" is ``trace.completion_tokens`` (counted when a token is
sampled); a ``Recorder`` keeps it at the moment of each cancel.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenbelt import EndReason, Limits, Model, Runtime, Stream
from tokenbelt.engines import BatchEngine, Message
from tokenbelt.models import default_model_path

from . import NET, Recorder, wait_until

pytestmark = pytest.mark.model

SLOTS = 4
GREEDY: dict[str, Any] = {"temperature": 0.0}
SEA: list[Message] = [{"role": "user", "content": "Tell me about the sea."}]
HELLO: list[Message] = [{"role": "user", "content": "Say hello."}]
ARTIFACTS = Path(os.environ.get("TOKENBELT_ARTIFACTS", "test-artifacts"))


_WORDS = ["the", "sea", "is", "wide", "and", "deep", "blue", "under", "a", "grey", "sky"]


def long_text(words: int) -> str:
    """About one token per word on the default model."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def runtime(recorder: Recorder) -> Iterator[Runtime]:
    rt = Runtime(slots=SLOTS, keep_alive=None, n_ctx=2048, observers=[recorder])
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture(scope="module")
def model(runtime: Runtime) -> Model:
    return runtime.load(str(default_model_path()))


@pytest.fixture
def plain(recorder: Recorder) -> Iterator[Model]:
    """Four slots without the prefix cache, for tests that compare greedy texts: a
    prompt partly copied from another sequence's cells is computed with other
    arithmetic (one token instead of a batch) and may flip a near tie."""
    rt = Runtime(slots=SLOTS, keep_alive=None, n_ctx=2048, prefix_cache=False, observers=[recorder])
    try:
        yield rt.load(str(default_model_path()))
    finally:
        rt.close()


def engine_of(model: Model) -> BatchEngine:
    engine = model.engines[0]
    assert isinstance(engine, BatchEngine)
    return engine


def _common(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def read_all(stream: Stream) -> threading.Thread:
    t = threading.Thread(target=stream.read, name=f"reader-{stream.request_id}", daemon=True)
    t.start()
    return t


def test_one_context_serves_four_sequences(model: Model) -> None:
    engine = engine_of(model)
    assert engine.slots == SLOTS
    assert model.statistics().slots == SLOTS
    assert model.info["slots"] == SLOTS
    assert model.info["n_ctx_per_seq"] == 2048
    assert model.info["threads"] >= 1


def test_stops_in_prefill_and_decode_leave_the_two_survivors_alone(
    plain: Model, recorder: Recorder
) -> None:
    model = plain
    before = engine_of(model).statistics()
    survivors = [model.stream(SEA, max_tokens=48, **GREEDY) for _ in range(2)]
    readers = [read_all(s) for s in survivors]
    in_decode = model.stream(SEA, max_tokens=400, capacity=64, **GREEDY)
    wait_until(lambda: in_decode.trace.completion_tokens >= 5, "decode of the third stream")
    in_prefill = model.stream(prompt=long_text(900), max_tokens=16, **GREEDY)
    wait_until(lambda: in_prefill.trace.admitted is not None, "admission of the long prompt")

    assert in_prefill.cancel()
    assert in_decode.cancel()
    for stream in (in_prefill, in_decode):
        assert stream.wait_released(NET)
    at_prefill_cancel = recorder.wait(in_prefill.request_id, "cancel_requested")
    at_decode_cancel = recorder.wait(in_decode.request_id, "cancel_requested")
    # Out before the next step: at most the token of the step in flight is computed.
    assert in_decode.trace.completion_tokens - at_decode_cancel.completion_tokens <= 1
    assert at_prefill_cancel.completion_tokens == 0
    assert in_prefill.trace.first_token is None
    for stream in (in_prefill, in_decode):
        assert stream.end_reason is EndReason.USER_CANCEL
        assert stream.trace.cancel_to_release is not None
        assert stream.trace.cancel_to_release < 1.0

    for t in readers:
        t.join(NET)
    for s in survivors:
        assert s.end_reason is EndReason.LENGTH  # a cancelled neighbour changed nothing
        assert s.trace.completion_tokens == 48
    # The same greedy prompt in the same steps: the same start (the rows' sums follow
    # their place in the batch on some CPUs, so a near tie may part them later).
    assert _common(survivors[0].text, survivors[1].text) >= 20
    after = engine_of(model).statistics()
    assert after.steps > before.steps
    assert after.sequences_per_step > 1.0  # they really ran together
    peers = set(survivors[0].trace.batched_with)
    assert survivors[1].request_id in peers


def test_a_paused_reader_holds_only_its_own_stream(model: Model) -> None:
    paused = model.stream(SEA, max_tokens=200, capacity=4, **GREEDY)
    others = [model.stream(SEA, max_tokens=40, **GREEDY) for _ in range(3)]
    readers = [read_all(s) for s in others]
    for t in readers:
        t.join(NET)
    for s in others:
        assert s.end_reason is EndReason.LENGTH
        assert s.trace.decode_rate is not None
    # Never more than capacity + 1 ahead (the step in flight) while nobody reads it.
    assert paused.trace.completion_tokens <= 4 + 1
    assert paused.statistics().buffered <= 4
    assert paused.end_reason is None
    # Reading again resumes it.
    pieces = iter(paused)
    for _ in range(10):
        next(pieces)
    assert paused.trace.completion_tokens >= 10
    paused.cancel()
    assert paused.wait_released(NET)


def test_deadlines_count_from_the_enqueue_mark_itself(model: Model) -> None:
    # One clock reading for both: a deadline taken a moment before the enqueue mark
    # once fired a first-token timeout 0.4 ms before enqueued + limit.
    stream = model.stream(HELLO, max_tokens=1, limits=Limits(first_token=30, total=60), **GREEDY)
    try:
        deadlines = stream._belt._deadlines
        assert stream.trace.enqueued is not None
        assert deadlines.first_token == stream.trace.enqueued + 30
        assert deadlines.total == stream.trace.enqueued + 60
    finally:
        stream.cancel()
        assert stream.wait_released(NET)


def test_a_queued_request_times_out_at_its_deadline_with_no_reader(model: Model) -> None:
    holders = [model.stream(SEA, max_tokens=400, capacity=1, **GREEDY) for _ in range(SLOTS)]
    wait_until(lambda: all(h.trace.first_token for h in holders), "all slots busy")
    queued = model.stream(HELLO, limits=Limits(first_token=0.2), **GREEDY)
    assert model.statistics().queued == 1
    try:
        # Nobody reads ``queued``: the runtime's deadline timer must end it.
        assert queued.wait_released(NET)
        trace = queued.trace
        assert queued.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
        assert trace.admitted is None  # it left the queue, never took a slot
        assert trace.enqueued is not None
        assert trace.released is not None
        late = trace.released - (trace.enqueued + 0.2)
        assert 0 <= late < 0.05, f"released {late * 1000:.1f} ms after its deadline"
        assert model.statistics().queued == 0
    finally:
        for h in holders:
            h.cancel()
        for h in holders:
            assert h.wait_released(NET)


@pytest.mark.timeout(300)
def test_running_streams_keep_producing_through_a_long_prefill(model: Model) -> None:
    running = [model.stream(SEA, max_tokens=400, **GREEDY) for _ in range(3)]
    readers = [read_all(s) for s in running]
    try:
        wait_until(lambda: all(s.trace.completion_tokens >= 5 for s in running), "decode")
        long = model.stream(prompt=long_text(800), max_tokens=4, **GREEDY)
        admitted_tokens = [s.trace.completion_tokens for s in running]
        # A busy machine makes this prefill slow (seconds per chunk): a wider net.
        wait_until(lambda: long.trace.first_token is not None, "its first token", 4 * NET)
        during = [
            s.trace.completion_tokens - n for s, n in zip(running, admitted_tokens, strict=True)
        ]
        prefill_s = long.trace.first_token - (long.trace.admitted or 0.0)  # type: ignore[operator]
        long.read()
    finally:
        for s in running:
            s.cancel()
        for t in readers:
            t.join(NET)
    gaps = [max(s.trace.token_gaps) for s in running]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "batch-prefill-gaps.json").write_text(
        json.dumps(
            {
                "prompt_tokens": long.trace.prompt_tokens,
                "prefill_ms": round(prefill_s * 1000, 1),
                "tokens_during_prefill": during,
                "max_gap_ms": [round(g * 1000, 1) for g in gaps],
                "prefill_chunk": model.info["prefill_chunk"],
            }
        )
    )
    assert long.trace.prompt_tokens > 700
    # Each running stream kept producing while the long prompt was evaluated in chunks.
    assert all(n >= 3 for n in during), during
    # No gap as long as the whole prefill: the budget splits it across steps.
    assert max(gaps) < prefill_s, (gaps, prefill_s)


@pytest.mark.parametrize(("gap", "chunk"), [(0.0, 32), (60.0, 510)])
def test_a_long_prompt_beside_a_running_stream_takes_what_the_gap_fits(
    gap: float, chunk: int
) -> None:
    # 512-token batches, 2 slots: with room for 60 s, a step takes the whole prompt.
    rt = Runtime(
        slots=2, keep_alive=None, n_ctx=1024, prefill_chunk=32, prefill_gap=gap, prefix_cache=False
    )
    try:
        model = rt.load(str(default_model_path()))
        engine = engine_of(model)
        model.complete(prompt=long_text(300), max_tokens=1)  # alone: times the prompt rate
        assert engine.prompt_chunk() == chunk
        running = model.stream(SEA, max_tokens=1000, **GREEDY)
        reader = read_all(running)
        try:
            wait_until(lambda: running.trace.completion_tokens >= 2, "decode")
            before = engine.statistics().steps
            long = model.stream(prompt=long_text(400), max_tokens=1, **GREEDY)
            long.read()
            steps = engine.statistics().steps - before
        finally:
            running.cancel()
            reader.join(NET)
    finally:
        rt.close()
    assert long.trace.prompt_tokens >= 400
    if gap:
        assert steps <= 6, steps  # the prompt in one step, beside the stream's own steps
    else:
        assert steps >= 400 // 31, steps  # 31 prompt tokens and the stream's token a step


def test_prefix_cache_reuses_a_shared_system_prompt(model: Model) -> None:
    system = "You answer questions about this text. " + long_text(500)
    first = model.stream(
        [{"role": "system", "content": system}, {"role": "user", "content": "First?"}],
        max_tokens=4,
        **GREEDY,
    )
    first.read()
    second = model.stream(
        [{"role": "system", "content": system}, {"role": "user", "content": "Second?"}],
        max_tokens=4,
        **GREEDY,
    )
    reply = second.read()
    assert first.trace.prompt_tokens > 500
    assert reply.trace.cached_tokens > 500
    assert reply.trace.cached_tokens < reply.trace.prompt_tokens
    assert second.trace.to_dict()["cached_tokens"] == reply.trace.cached_tokens
    ttft_1 = first.trace.time_to_first_token
    ttft_2 = second.trace.time_to_first_token
    assert ttft_1 is not None
    assert ttft_2 is not None
    assert ttft_2 < ttft_1


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_the_runtimes_cache_tokens_bound_what_a_prompt_leaves(isolation: str) -> None:
    """``Runtime(cache_tokens=...)`` reaches the engine, in process or in a worker: a
    prompt longer than the cache leaves its first ``cache_tokens``, and the memory
    estimate counts that many tokens' worth."""
    system = "You answer questions about this text. " + long_text(300)
    with Runtime(keep_alive=None, n_ctx=2048, cache_tokens=128, isolation=isolation) as rt:
        model = rt.load(str(default_model_path()))
        turns = [
            model.stream(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                max_tokens=2,
                **GREEDY,
            ).read()
            for q in ("First?", "Second?")
        ]
        estimate = model.info["memory_estimate"]
    assert turns[0].trace.prompt_tokens > 300
    assert 100 < turns[1].trace.cached_tokens <= 128
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) x 2 bytes a token
    assert estimate["cache"] == 30 * 3 * 128 * 2 * 128


def test_greedy_text_alone_and_beside_other_sequences(plain: Model) -> None:
    """Greedy text of one prompt alone and in batches of four: the same start, not the
    same text.

    Measured on this build (prefix cache off): alone, in a batch beside three other
    prompts, and in another slot of a batch beside other neighbours, the text first
    differs after a few dozen characters. llama.cpp's CPU matrix kernels take another
    path for one row than for several, and a batch's size changes as its neighbours
    end, so the logits differ in their last bits and greedy decoding flips at a near
    tie. (With the prefix cache on, a prompt partly copied from another sequence's
    cells is computed differently again.) On some CPUs even two sequences that share
    every step (the survivors of the stop test) part at a near tie: a row's sums follow
    its place in the batch.
    """
    model = plain
    engine = engine_of(model)

    def batch(first: list[Message], rest: list[Message]) -> list[str]:
        streams = [model.stream(first, max_tokens=32, **GREEDY)]
        streams += [model.stream(rest, max_tokens=32, **GREEDY) for _ in range(3)]
        readers = [read_all(s) for s in streams]
        for t in readers:
            t.join(NET)
        assert engine.statistics().running == 0
        return [s.text for s in streams]

    alone = model.stream(SEA, max_tokens=32, **GREEDY).read().text
    with_hellos = batch(SEA, HELLO)[0]
    other_slot = batch(HELLO, SEA)[1]  # SEA in another slot, other neighbours
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "batch-greedy.json").write_text(
        json.dumps(
            {
                "alone": alone,
                "batched": with_hellos,
                "other_slot": other_slot,
                "common_prefix_chars": _common(alone, with_hellos),
                "batched_equals_alone": alone == with_hellos,
                "other_slot_equals_batched": other_slot == with_hellos,
            }
        )
    )
    for text in (with_hellos, other_slot):
        assert _common(alone, text) >= 20  # the same start; a near tie may flip later


def test_a_prompt_longer_than_a_sequence_is_refused_before_queueing(model: Model) -> None:
    from tokenbelt import PromptTooLong

    before = model.statistics()
    with pytest.raises(PromptTooLong, match="each sequence holds 2048"):
        model.stream(prompt=long_text(3000))
    assert model.statistics().queued == before.queued


def test_a_stop_before_admission_releases_without_waiting_for_the_step(
    model: Model, recorder: Recorder
) -> None:
    """A request handed to the engine but not yet admitted holds no KV cells: its stop
    releases it at once, not at the end of the step in flight."""
    engine = engine_of(model)
    long = model.stream(prompt=long_text(1800), max_tokens=2, **GREEDY)
    wait_until(lambda: engine.statistics().tokens_stepped > 0 and long.trace.admitted, "prefill")
    steps_before = engine.statistics().steps
    late = model.stream(HELLO, **GREEDY)
    assert late.cancel()
    assert late.wait_released(NET)
    steps_at_release = engine.statistics().steps
    assert late.end_reason is EndReason.USER_CANCEL
    assert late.trace.admitted is None
    assert long.trace.first_token is None  # the long prefill was still running
    assert steps_at_release == steps_before, "the release waited for a step to end"
    long.cancel()
    assert long.wait_released(NET)


def test_a_chat_reuses_its_previous_turn_through_the_prefix_cache(model: Model) -> None:
    with model.chat(system="You are terse.", temperature=0.0) as chat:
        first = chat.send("Tell me about the sea.", max_tokens=16)
        second = chat.send("And the sky?", max_tokens=8)
    assert first.end_reason.is_natural
    # The second turn's prompt is the first turn's prompt and reply, then the new
    # message: all of the first prompt at least comes from the cache.
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert second.usage.cached_tokens < second.usage.prompt_tokens


def test_a_prompt_is_templated_and_tokenized_once(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count before queueing (on the caller's thread) serves the admission too: the
    loop every stream waits on does not tokenize the same prompt again."""
    prompts = engine_of(model)._prompts  # where every prompt of the engine is made
    calls: list[int] = []
    tokenize = prompts.tokenize

    def counting(request: Any) -> list[int]:
        calls.append(1)
        return tokenize(request)

    monkeypatch.setattr(prompts, "tokenize", counting)
    reply = model.stream(HELLO, max_tokens=2, **GREEDY).read()
    assert reply.end_reason.is_natural
    assert len(calls) == 1


def test_the_warm_up_step_runs_on_the_loop_thread_and_leaves_no_cells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Load ends with one throwaway step, taken by the thread that runs every later step
    (a second OpenMP team in the process would throttle the loop's), and the context
    it leaves holds nothing."""
    import llama_cpp

    seen: list[str] = []
    warm_up = BatchEngine._warm_up

    def recording(self: BatchEngine) -> None:
        seen.append(threading.current_thread().name)
        warm_up(self)

    monkeypatch.setattr(BatchEngine, "_warm_up", recording)
    engine = BatchEngine(default_model_path(), slots=1, n_ctx=256, cache_entries=0)
    try:
        assert seen == [engine._thread.name]
        assert llama_cpp.llama_memory_seq_pos_max(engine._mem, 0) == -1
        assert engine.statistics().steps == 0
    finally:
        engine.close()
