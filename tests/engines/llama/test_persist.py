"""Prefix caches that survive an unload: saved at close, restored at the next load.

The real default model throughout; every directory is the test's own ``tmp_path``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tokenbelt import EndReason, GenerationRequest, Runtime
from tokenbelt.belt import Belt, Trace
from tokenbelt.engines import BatchEngine, BatchStatistics, Message, WorkerEngine
from tokenbelt.models import default_model_path

from .test_batch import NET, greedy, long_text

pytestmark = pytest.mark.model
logger = logging.getLogger(__name__)

QUESTION = "What colour is the sea in this text?"


#: a prompt with a system text of its own shares its first few tokens ("<|im_start|>system")
#: with the chat template's head that each load computes and caches (the warm-up): a
#: prompt that got no more than that from the cache was computed cold
TEMPLATE_START = 8


def conversation(words: int, *turns: str, lead: str = "") -> list[Message]:
    """A long system text (after ``lead``), then user turns (each answered "Blue." but
    the last)."""
    messages: list[Message] = [{"role": "system", "content": lead + long_text(words)}]
    for i, turn in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": "Blue."})
        messages.append({"role": "user", "content": turn})
    return messages


def load(directory: Path | None, model: Path | None = None, **options: Any) -> BatchEngine:
    params: dict[str, Any] = {"slots": 1, "n_ctx": 2048, "cache_tokens": 2048}
    params.update(options)
    return BatchEngine(model or default_model_path(), prefix_cache_dir=directory, **params)


class Answer(NamedTuple):
    text: str
    trace: Trace
    end_reason: EndReason | None


def ask(engine: BatchEngine | WorkerEngine, messages: list[Message]) -> Answer:
    """Greedy, a few tokens, read to the end and released."""
    belt: Belt[str] = Belt(64)
    belt.trace.mark_enqueued()
    engine.start(GenerationRequest.chat(messages, greedy(6)), belt.producer)
    text = "".join(belt)
    assert belt.wait_released(NET)
    return Answer(text, belt.trace, belt.end_reason)


def first_token_s(answer: Answer) -> float:
    trace = answer.trace
    assert trace.first_token is not None
    assert trace.enqueued is not None
    return trace.first_token - trace.enqueued


def saved_once(directory: Path, *prompts: list[Message], **options: Any) -> BatchStatistics:
    """Answer ``prompts`` on an engine saving into ``directory``, close it: its counters."""
    engine = load(directory, **options)
    try:
        for messages in prompts:
            ask(engine, messages)
    finally:
        engine.close()
    return engine.statistics()


def sets(directory: Path) -> list[Path]:
    return sorted(d for d in directory.iterdir() if d.is_dir()) if directory.exists() else []


def disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def test_the_next_turn_after_a_reload_reuses_the_saved_prefix(tmp_path: Path) -> None:
    first = conversation(1000, QUESTION)
    engine = load(tmp_path)
    try:
        cold = ask(engine, first)
    finally:
        engine.close()
    saved = engine.statistics()
    assert saved.saved_entries == 1
    assert 0 < saved.saved_bytes <= disk_bytes(tmp_path)

    engine = load(tmp_path)
    try:
        restored = engine.statistics()
        warm = ask(engine, conversation(1000, QUESTION, "And the sky?"))
        after = engine.statistics()
    finally:
        engine.close()
    assert restored.restored_entries == 1
    assert restored.restored_tokens > 1000
    assert restored.cache_entries == 2  # and the chat template's head, computed at load
    assert cold.trace.cached_tokens < TEMPLATE_START
    assert warm.trace.cached_tokens > 1000
    assert warm.trace.cached_tokens < warm.trace.prompt_tokens
    assert after.prefix_hits == 1
    assert after.prefix_cached_tokens == warm.trace.cached_tokens
    assert warm.end_reason is not None
    assert warm.end_reason.is_natural
    assert warm.text.strip()
    # Reported, not asserted (benchmarks/restore.py measures it): shown with log_cli.
    logger.info(
        "first token: %.3f s after a restore, %.3f s for the cold prefill",
        first_token_s(warm),
        first_token_s(cold),
    )


def test_restored_cells_give_the_greedy_text_of_a_cold_computation(tmp_path: Path) -> None:
    assert saved_once(tmp_path, conversation(200, QUESTION)).saved_entries == 1
    nxt = conversation(200, QUESTION, "And the sky?")
    engine = load(tmp_path)
    try:
        warm = ask(engine, nxt)
    finally:
        engine.close()
    off = load(None, cache_entries=0)
    try:
        cold = ask(off, nxt)
    finally:
        off.close()
    assert warm.trace.cached_tokens > 200
    assert cold.trace.cached_tokens < TEMPLATE_START
    assert warm.text == cold.text


def test_another_kv_type_restores_nothing_and_removes_the_stale_set(tmp_path: Path) -> None:
    short = conversation(60, QUESTION)
    assert saved_once(tmp_path, short).saved_entries == 1
    (f16_set,) = sets(tmp_path)

    engine = load(tmp_path, kv_type="q8_0")
    try:
        assert engine.statistics().restored_entries == 0
        assert not f16_set.exists()
        assert ask(engine, short).trace.cached_tokens < TEMPLATE_START
    finally:
        engine.close()
    (q8_set,) = sets(tmp_path)
    assert q8_set != f16_set


def test_a_changed_model_file_restores_nothing_and_removes_the_stale_set(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), model)
    cache = tmp_path / "cache"
    short = conversation(60, QUESTION)
    assert saved_once(cache, short, model=model).saved_entries == 1
    (old,) = sets(cache)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file was replaced

    engine = load(cache, model)
    try:
        assert engine.statistics().restored_entries == 0
        assert not old.exists()
        assert ask(engine, short).trace.cached_tokens < TEMPLATE_START
    finally:
        engine.close()


def test_a_corrupt_or_truncated_file_is_skipped_with_one_warning_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    one, two = conversation(60, QUESTION), conversation(60, "Is it deep?")
    other: list[Message] = [{"role": "user", "content": "Say hello."}]
    assert saved_once(tmp_path, one, other).saved_entries == 2
    (saved,) = sets(tmp_path)
    corrupt, truncated = sorted(saved.glob("*.kv"))
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    (saved / "0002.kv").write_bytes(b"not a cache entry at all")

    with caplog.at_level(logging.WARNING, logger="tokenbelt.engines.batch"):
        engine = load(tmp_path)
    try:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 3, [r.getMessage() for r in warnings]
        assert all("skipped" in r.getMessage() for r in warnings)
        assert engine.statistics().restored_entries == 0
        assert not list(saved.glob("*.kv"))  # removed: they warn once, not at every load
        reply = ask(engine, two)
        assert reply.end_reason is not None
        assert reply.end_reason.is_natural
        assert reply.text
    finally:
        engine.close()


def test_a_conversation_longer_than_the_cache_leaves_its_head() -> None:
    """A sequence longer than ``cache_tokens`` leaves its first ``cache_tokens`` (an
    agent's long prompt starts with its instructions and tools: the part each turn
    shares), not nothing."""
    engine = load(None, cache_tokens=256)
    try:
        first = ask(engine, conversation(600, QUESTION))
        again = ask(engine, conversation(600, QUESTION, "And the sky?"))
    finally:
        engine.close()
    assert first.trace.prompt_tokens > 600
    assert 200 < again.trace.cached_tokens <= 256


def test_a_saved_set_larger_than_the_kv_cache_is_read_back_one_entry_at_a_time(
    tmp_path: Path,
) -> None:
    """The KV cache has cells for the running sequences only (entries live in memory):
    one slot of 512 here, so three saved entries of ~300 tokens (more than the cells
    together) are checked and freed one after another, and each serves its turn."""
    leads = ("First text. ", "Second text. ", "Third text. ")
    prompts = [conversation(250, QUESTION, lead=lead) for lead in leads]
    options: dict[str, Any] = {"n_ctx": 512, "cache_tokens": 4096, "cache_entries": 8}
    saved = saved_once(tmp_path, *prompts, **options)
    assert saved.saved_entries == 3
    engine = load(tmp_path, **options)
    try:
        cells = engine._lib.llama_n_ctx(engine._ctx.ctx)
        assert cells < 512 + 256  # one slot's, rounded up as llama.cpp pads; no slack
        restored = engine.statistics()
        assert restored.restored_entries == 3
        assert restored.restored_tokens > cells
        for lead in leads:
            turn = ask(engine, conversation(250, QUESTION, "Why?", lead=lead))
            assert turn.trace.cached_tokens > 250
    finally:
        engine.close()


def test_the_disk_budget_keeps_the_most_recent_entries_that_fit(tmp_path: Path) -> None:
    older = conversation(50, QUESTION, lead="Read this. ")
    newer = conversation(50, QUESTION, lead="Now this: ")
    # Learn one entry's size, then give room for one entry and not two.
    measure = saved_once(tmp_path / "measure", newer)
    budget = measure.saved_bytes * 3 // 2

    nothing = saved_once(tmp_path / "tiny", older, newer, prefix_cache_disk=1000)
    assert (nothing.saved_entries, nothing.saved_bytes) == (0, 0)
    assert sets(tmp_path / "tiny") == []

    cache = tmp_path / "cache"
    saved = saved_once(cache, older, newer, prefix_cache_disk=budget)
    assert saved.saved_entries == 1
    assert disk_bytes(cache) <= budget
    engine = load(cache)
    try:
        assert engine.statistics().restored_entries == 1
        # The set holds only the most recently used of the two: the one asked last (the
        # other shares only the chat template's first tokens with it).
        again = conversation(50, QUESTION, "Why?", lead="Now this: ")
        assert ask(engine, again).trace.cached_tokens > 50
        assert (
            ask(engine, conversation(50, QUESTION, "Why?", lead="Read this. ")).trace.cached_tokens
            < 10
        )
    finally:
        engine.close()


def test_other_models_sets_go_least_recently_used_first_to_keep_the_budget(
    tmp_path: Path,
) -> None:
    short = conversation(100, QUESTION)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(default_model_path(), copy)
    cache = tmp_path / "cache"
    one = saved_once(cache, short, model=copy)
    (copy_set,) = sets(cache)
    budget = one.saved_bytes * 3 // 2  # room for one model's set, not two
    saved_once(cache, short, prefix_cache_disk=budget)
    (kept,) = sets(cache)
    assert kept != copy_set
    assert disk_bytes(cache) <= budget


def test_a_worker_engine_saves_at_close_and_restores_at_load(tmp_path: Path) -> None:
    """The options are plain values: they reach the worker's ``BatchEngine`` as given."""
    first = conversation(150, QUESTION)
    options: dict[str, Any] = {"slots": 1, "n_ctx": 2048, "prefix_cache_dir": str(tmp_path)}
    engine = WorkerEngine.load(default_model_path(), **options)
    try:
        ask(engine, first)
    finally:
        engine.close()
    assert sets(tmp_path)
    engine = WorkerEngine.load(default_model_path(), **options)
    try:
        answer = ask(engine, conversation(150, QUESTION, "And the sky?"))
        stats = engine.statistics()
    finally:
        engine.close()
    assert answer.trace.cached_tokens > 150
    assert stats.restored_entries == 1
    assert stats.restored_tokens > 150


def test_a_process_runtime_reuses_the_prefix_after_an_unload(tmp_path: Path) -> None:
    first = conversation(150, QUESTION)
    with Runtime(
        keep_alive=None, n_ctx=2048, slots=1, isolation="process", prefix_cache_dir=tmp_path
    ) as rt:
        model = rt.load(str(default_model_path()))
        cold = model.complete(first, max_tokens=4, temperature=0.0)
        assert cold.trace.cached_tokens < TEMPLATE_START
        rt.unload(model.name)
        started = time.monotonic()
        model = rt.load(str(default_model_path()))
        reply = model.complete(
            conversation(150, QUESTION, "And the sky?"), max_tokens=4, temperature=0.0
        )
        assert time.monotonic() - started < NET
    assert reply.trace.cached_tokens > 150
    assert reply.trace.cached_tokens < reply.trace.prompt_tokens


def test_a_budget_of_zero_writes_nothing(tmp_path: Path) -> None:
    load(tmp_path / "idle").close()  # no entries: not even a folder
    assert not (tmp_path / "idle").exists()
    assert saved_once(tmp_path, conversation(60, QUESTION), prefix_cache_disk=0).saved_entries == 0
    assert list(tmp_path.iterdir()) == []
