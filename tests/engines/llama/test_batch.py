"""The batch engine driven directly, without a runtime: a stop inside a step, the prefix
cache, and a paused reader beside a running one.

One engine (two sequences of one context) is loaded for the module on the real default
model. Each request gets a belt of its own and goes in through ``start`` as the
scheduler hands it over; the test reads (or does not read) the belt itself.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tokenbelt import EndReason, GenerationRequest, InvalidArgument, SamplingParams
from tokenbelt.belt import Belt
from tokenbelt.engines import BatchEngine, BatchStatistics, LoopEngine, Message
from tokenbelt.models import default_model_path

pytestmark = pytest.mark.model

#: a safety net for waits and joins, never the assertion itself
NET = 60.0
_WORDS = ["the", "sea", "is", "wide", "and", "deep", "blue", "under", "a", "grey", "sky"]
SEA: list[Message] = [{"role": "user", "content": "Tell me about the sea."}]


def long_text(words: int) -> str:
    """About one token per word on the default model."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


@pytest.fixture(scope="module")
def engine() -> Iterator[BatchEngine]:
    batch = BatchEngine(default_model_path(), slots=2, n_ctx=2048)
    try:
        yield batch
    finally:
        batch.close()


def start(engine: BatchEngine, request: GenerationRequest, capacity: int = 64) -> Belt[str]:
    """Hand ``request`` to the engine as the scheduler does, on a belt of its own."""
    belt: Belt[str] = Belt(capacity)
    belt.trace.mark_enqueued()
    engine.start(request, belt.producer)
    return belt


def poll(predicate: Callable[[], bool], what: str) -> None:
    """Wait (under the safety net) for ``predicate()`` to hold."""
    deadline = time.monotonic() + NET
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {NET} s")
        time.sleep(0.005)


def test_is_a_loop_engine_with_its_counters(engine: BatchEngine) -> None:
    assert isinstance(engine, LoopEngine)
    stats = engine.statistics()
    assert isinstance(stats, BatchStatistics)
    assert (stats.slots, stats.worker, stats.upstreams) == (2, None, None)


def test_a_stop_inside_a_prefill_step_releases_the_sequence_within_that_step(
    engine: BatchEngine,
) -> None:
    """The stop lands while a prompt chunk is computed: the sequence leaves with that
    step (aborted through the native hook, or ended), never after a further step, and the
    rest of its prompt is never computed."""
    before = engine.statistics()
    belt = start(engine, GenerationRequest(prompt=long_text(1800), sampling=greedy(2)))
    poll(lambda: engine.statistics().tokens_stepped > before.tokens_stepped, "the prefill")
    at_stop = engine.statistics()
    assert belt.cancel(EndReason.USER_CANCEL)
    assert belt.wait_released(NET)
    after = engine.statistics()
    assert belt.end_reason is EndReason.USER_CANCEL
    assert belt.trace.first_token is None  # still in its prefill
    assert after.steps - at_stop.steps <= 1, "the release waited for more than the step"
    assert after.tokens_stepped - before.tokens_stepped < belt.trace.prompt_tokens
    assert after.running == 0


def test_the_prefix_cache_reuses_a_shared_prompt_prefix(engine: BatchEngine) -> None:
    system = "You answer questions about this text. " + long_text(300)

    def ask(question: str) -> Belt[str]:
        messages: list[Message] = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
        belt = start(engine, GenerationRequest.chat(messages, greedy(4)))
        "".join(belt)
        assert belt.wait_released(NET)
        return belt

    first = ask("First?")
    before = engine.statistics()
    second = ask("Second?")
    after = engine.statistics()
    assert first.trace.prompt_tokens > 300
    assert second.trace.cached_tokens > 300
    assert second.trace.cached_tokens < second.trace.prompt_tokens
    assert after.prefix_hits == before.prefix_hits + 1
    assert after.prefix_cached_tokens - before.prefix_cached_tokens == second.trace.cached_tokens


def test_a_stopped_request_leaves_what_it_computed_to_the_prefix_cache(
    engine: BatchEngine,
) -> None:
    """Stopped after its first tokens, a request keeps its prompt's (and those tokens')
    cells: the same prompt again computes only its last token (before, a stop freed
    them, and a Stop in a chat cost the next turn its whole prompt)."""
    engine.clear_prefix_cache()
    messages: list[Message] = [
        {"role": "system", "content": "Stopped early. " + long_text(250)},
        {"role": "user", "content": "Go on."},
    ]
    stopped = start(engine, GenerationRequest.chat(messages, greedy(400)))
    poll(lambda: stopped.trace.completion_tokens >= 3, "the first tokens")
    assert stopped.cancel(EndReason.USER_CANCEL)
    assert stopped.wait_released(NET)
    assert stopped.end_reason is EndReason.USER_CANCEL
    again = start(engine, GenerationRequest.chat(messages, greedy(2)))
    "".join(again)
    assert again.wait_released(NET)
    assert again.trace.prompt_tokens == stopped.trace.prompt_tokens > 250
    # Every prompt token but the last (its logits are computed again) came from the cache.
    assert again.trace.cached_tokens == again.trace.prompt_tokens - 1


@pytest.mark.parametrize("cache_entries", [8, 0])
def test_the_first_chat_request_after_a_load_starts_from_the_template_head(
    cache_entries: int,
) -> None:
    """The load's warm-up step computes the chat template's head (the default model's:
    its default system prompt) and caches it, so a first question computes only its
    own tokens; with the prefix cache off, nothing is kept and all of it is computed."""
    fresh = BatchEngine(default_model_path(), slots=1, n_ctx=512, cache_entries=cache_entries)
    try:
        assert fresh.statistics().cache_entries == min(cache_entries, 1)
        belt = start(fresh, GenerationRequest.chat(SEA, greedy(2)))
        "".join(belt)
        assert belt.wait_released(NET)
    finally:
        fresh.close()
    if cache_entries:
        assert 10 < belt.trace.cached_tokens < belt.trace.prompt_tokens - 5
    else:
        assert belt.trace.cached_tokens == 0


def test_cache_entries_hold_no_cells_of_the_kv_cache(engine: BatchEngine) -> None:
    """Entries are kept in memory, not as cells: cells kept for later would make every
    row of every step look at them. Once a request is cached and nothing runs, no
    sequence holds a cell; the next request with that prompt still reuses it."""
    messages: list[Message] = [
        {"role": "system", "content": "Kept aside. " + long_text(200)},
        {"role": "user", "content": "Why?"},
    ]
    first = start(engine, GenerationRequest.chat(messages, greedy(3)))
    "".join(first)
    assert first.wait_released(NET)
    assert engine.statistics().cache_entries >= 1
    lib, memory = engine._lib, engine._mem

    def held() -> list[int]:
        return [i for i in range(engine.n_seq_max) if lib.llama_memory_seq_pos_max(memory, i) >= 0]

    # The copy into the cache comes right after the release, on the engine's thread.
    poll(lambda: held() == [], "every cell freed")
    assert engine.statistics().cache_entries >= 1
    again = start(engine, GenerationRequest.chat(messages, greedy(3)))
    "".join(again)
    assert again.wait_released(NET)
    assert again.trace.cached_tokens == again.trace.prompt_tokens - 1


def test_a_paused_reader_pauses_only_its_own_sequence(engine: BatchEngine) -> None:
    """Nobody reads the first belt: its sequence stops at the belt's capacity while the
    other runs to its end beside it; reading again resumes it."""
    paused = start(engine, GenerationRequest.chat(SEA, greedy(200)), capacity=4)
    running = start(engine, GenerationRequest.chat(SEA, greedy(24)))
    text = "".join(running)
    assert running.wait_released(NET)
    assert running.end_reason is EndReason.LENGTH
    assert running.trace.completion_tokens == 24
    assert text
    # The engine checks for room before each step: never a token past the capacity.
    poll(lambda: paused.statistics().buffered == 4, "the paused belt full")
    assert paused.trace.completion_tokens == 4
    assert paused.end_reason is None
    pieces = iter(paused)
    for _ in range(10):
        next(pieces)
    assert paused.trace.completion_tokens >= 10
    assert paused.cancel(EndReason.USER_CANCEL)
    assert paused.wait_released(NET)
    assert engine.statistics().running == 0


def test_a_q8_0_kv_cache_takes_about_half_the_memory_and_still_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def kv_mib(kv_type: str) -> tuple[float, str]:
        caplog.clear()
        with caplog.at_level("DEBUG", logger="tokenbelt.engines.llama.native"):
            batch = BatchEngine(default_model_path(), slots=1, n_ctx=512, kv_type=kv_type)
        try:
            belt = start(batch, GenerationRequest.chat(SEA, greedy(8)))
            text = "".join(belt)
            assert belt.wait_released(NET)
        finally:
            batch.close()
        # llama.cpp's own account of the buffer it allocated for the cache
        sizes = [r.getMessage() for r in caplog.records if "KV buffer size" in r.getMessage()]
        assert sizes, "llama.cpp logged no KV buffer size"
        return float(sizes[-1].split("=")[1].split()[0]), text

    f16, f16_text = kv_mib("f16")
    q8, q8_text = kv_mib("q8_0")
    assert 0.45 * f16 < q8 < 0.6 * f16  # q8_0: 34 bytes per 32 values, f16: 64
    assert f16_text.strip()
    assert q8_text.strip()
    with pytest.raises(InvalidArgument, match="kv_type must be one of f16, q8_0"):
        BatchEngine(default_model_path(), kv_type="q4_0")
    with pytest.raises(InvalidArgument, match="flash_attn must be one of auto, on, off"):
        BatchEngine(default_model_path(), flash_attn="yes")
    with pytest.raises(InvalidArgument, match="a q8_0 KV cache needs flash attention"):
        BatchEngine(default_model_path(), kv_type="q8_0", flash_attn="off")


def slowed_engine(node_s: float, **options: Any) -> tuple[BatchEngine, threading.Event]:
    """A two-slot engine whose graph nodes each take ``node_s`` more while the event is
    set (as on a machine whose cores are busy), and that event."""
    slow = threading.Event()
    batch = BatchEngine(
        default_model_path(),
        slots=2,
        n_ctx=512,
        n_threads=1,
        n_threads_batch=1,
        cache_entries=0,
        **options,
    )

    def hook(stopped: bool) -> bool:
        if slow.is_set() and not stopped:
            time.sleep(node_s)
        return stopped

    batch.wrap_abort_hook(hook)
    return batch, slow


def test_a_stop_in_a_step_timed_longer_than_the_bound_aborts_it_at_once() -> None:
    """Steps that this engine timed at about 0.5 s (each graph node takes 1 ms): a stop
    that lands in one beside a running stream aborts it at once rather than after
    ``stop_abort_after`` (0.3 s here), since the step would outlast the bound anyway."""
    batch, slow = slowed_engine(0.001, stop_abort_after=0.3)
    try:
        slow.set()
        stopped = start(batch, GenerationRequest.chat(SEA, greedy(200)))
        beside = start(batch, GenerationRequest.chat(SEA, greedy(200)))
        both = (stopped, beside)
        poll(lambda: all(b.trace.completion_tokens >= 3 for b in both), "slow steps")
        steps = batch.statistics().steps
        poll(lambda: batch.statistics().steps > steps, "a step")
        time.sleep(0.02)  # inside the next step, which lasts about 0.5 s
        assert stopped.cancel(EndReason.USER_CANCEL)
        assert stopped.wait_released(NET)
        lag = stopped.trace.cancel_to_release
        assert lag is not None
        assert lag < 0.2, f"released {lag:.3f} s after its stop"
        assert batch.statistics().stop_aborted_steps >= 1
        assert beside.cancel(EndReason.USER_CANCEL)
        assert beside.wait_released(NET)
    finally:
        slow.clear()
        batch.close()


def test_a_stop_in_a_long_step_beside_another_stream_aborts_that_step() -> None:
    """A step that runs for seconds (here each graph node takes 4 ms, as on a machine
    whose cores are busy) while a stop lands in it beside a running stream: the stop
    watch aborts it ``stop_abort_after`` later instead of waiting for its end, and the
    stream beside it goes on from its KV: its next tokens are the ones it makes alone.
    Only the next ones: llama.cpp's CPU kernels sum a row by the batch's shape, so the
    text alone and beside another may part later at a near tie (on some CPUs within
    these 12 tokens, flash attention off or on)."""
    batch, slow = slowed_engine(0.004, flash_attn="off")
    try:
        alone = start(batch, GenerationRequest.chat(SEA, greedy(12)))
        expected = "".join(alone)
        assert alone.wait_released(NET)
        stopped = start(batch, GenerationRequest.chat(SEA, greedy(200)))
        beside = start(batch, GenerationRequest.chat(SEA, greedy(12)))
        poll(lambda: beside.trace.first_token is not None, "the first token beside")
        slow.set()
        steps = batch.statistics().steps
        poll(lambda: batch.statistics().steps > steps, "a step")
        time.sleep(0.1)  # a slow step is in flight now (it lasts seconds)
        made = beside.trace.completion_tokens
        assert stopped.cancel(EndReason.USER_CANCEL)
        assert stopped.wait_released(NET)
        slow.clear()
        lag = stopped.trace.cancel_to_release
        assert lag is not None
        assert lag < batch.config.stop_abort_after + 0.5, f"released {lag:.3f} s after its stop"
        assert batch.statistics().stop_aborted_steps >= 1
        pieces = list(beside)  # a token each
        assert beside.end_reason is EndReason.LENGTH
        assert len(pieces) == 12
        # What it made before the aborted step and the two tokens after it: a KV cell
        # lost or left by the abort would change them.
        assert expected.startswith("".join(pieces[: made + 2])), (expected, pieces, made)
    finally:
        slow.clear()
        batch.close()


class _CountingLib:
    """The binding with its ``llama_set_n_threads`` calls counted."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.set_calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def llama_set_n_threads(self, ctx: Any, threads: int, threads_batch: int) -> None:
        self.set_calls.append(threads)
        self._lib.llama_set_n_threads(ctx, threads, threads_batch)


def test_the_thread_count_is_given_to_llama_cpp_only_when_it_changes(
    engine: BatchEngine,
) -> None:
    """Each ``llama_set_n_threads`` logs a line through the binding's Python callback
    (about 35 us a step): the loop calls it when the tuner's choice changes, not each
    step, and the context still runs with the count the tuner chose."""
    lib = _CountingLib(engine._lib)
    engine._lib = lib
    try:
        sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        belt = start(engine, GenerationRequest.chat(SEA, sampling))
        assert "".join(belt)
        assert belt.wait_released(NET)
    finally:
        engine._lib = lib._lib
    steps = belt.trace.completion_tokens
    assert steps == 64
    calls = lib.set_calls
    assert all(a != b for a, b in itertools.pairwise(calls))  # only changes
    assert len(lib.set_calls) <= 2 + 2 * steps // 16  # exploring: there and back
    assert engine._lib.llama_n_threads(engine._ctx.ctx) == engine.threads


def test_a_requests_start_and_its_first_token_go_out_in_few_groups() -> None:
    """What the loop sends to a request comes in ``around_sampling`` groups (a worker
    writes each group as one frame, a wake-up of its parent's reader): the start with
    the prompt's count, what the prefix cache held with its read count, and the last
    prompt step's read count with the first token."""
    from tokenbelt.belt import Producer

    group: list[int | None] = [None]
    opened = itertools.count(1)
    log: list[tuple[str, int | None]] = []

    @contextlib.contextmanager
    def wrap() -> Iterator[None]:
        group[0] = next(opened)
        try:
            yield
        finally:
            group[0] = None

    class Recorded(Producer[str]):
        __slots__ = ()

        def start(self) -> None:
            log.append(("start", group[0]))
            super().start()

        def count_prompt(self, tokens: int) -> None:
            log.append(("prompt", group[0]))
            super().count_prompt(tokens)

        def count_cached(self, tokens: int) -> None:
            log.append(("cached", group[0]))
            super().count_cached(tokens)

        def count_read(self, tokens: int) -> None:
            log.append(("read", group[0]))
            super().count_read(tokens)

        def put_nowait(self, item: str) -> None:
            log.append(("put", group[0]))
            super().put_nowait(item)

    fresh = BatchEngine(default_model_path(), slots=1, n_ctx=512)
    try:
        fresh.around_sampling(wrap)
        belt: Belt[str] = Belt(8)
        fresh.start(GenerationRequest.chat(SEA, greedy(2)), Recorded(belt))
        "".join(belt)
        assert belt.wait_released(NET)
    finally:
        fresh.close()
    first_put = [name for name, _ in log].index("put")
    before = log[: first_put + 1]
    assert [name for name, _ in before] == ["start", "prompt", "cached", "read", "read", "put"]
    groups = [g for _, g in before]
    assert None not in groups, log
    assert groups[0] == groups[1] != groups[2] == groups[3] != groups[4] == groups[5]
