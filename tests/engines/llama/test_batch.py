"""The batch engine driven directly, without a runtime: a stop inside a step, the prefix
cache, and a paused reader beside a running one.

One engine (two sequences of one context) is loaded for the module on the real default
model. Each request gets a belt of its own and goes in through ``start`` as the
scheduler hands it over; the test reads (or does not read) the belt itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tokenbelt import EndReason, GenerationRequest, SamplingParams
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
