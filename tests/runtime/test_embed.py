"""Embeddings and rerank through the SDK: the same admission queue, deadlines, stops,
traces and end reasons as chat, beside chat on the same loaded model.

One runtime and the real default model (a chat model, pooled by ``mean``) for the
module; inputs are short so every test stays quick.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tokenbelt import (
    Cancelled,
    EndReason,
    InvalidArgument,
    Limits,
    Model,
    QueueFull,
    Runtime,
    ScriptedEngine,
)
from tokenbelt.models import Home, default_model_path

pytestmark = pytest.mark.model

NET = 60.0


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    # A small context: an input holds at most 128 tokens, so the longest test input is quick.
    rt = Runtime(keep_alive=None, n_ctx=128, slots=4, queue_size=2)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture(scope="module")
def model(runtime: Runtime) -> Model:
    return runtime.load(str(default_model_path()), load_timeout=120)


def test_embed_gives_unit_vectors_with_usage_and_a_trace(model: Model) -> None:
    done = model.embed(["a red apple", "a red apple", "the stock market fell"])
    assert done.array.shape == (3, 576)
    assert done.dimension == model.embedding_info().dimension == 576
    assert np.allclose(np.linalg.norm(done.array, axis=1), 1.0, atol=1e-5)
    assert done.vectors[0] == done.vectors[1]
    assert done.vectors[0] != done.vectors[2]
    assert done.end_reason is EndReason.STOP
    trace = done.trace.to_dict()
    assert (trace["kind"], trace["inputs"], trace["end_reason"]) == ("embed", 3, "stop")
    assert done.usage.prompt_tokens == trace["prompt_tokens"] > 3
    assert trace["timeline_ms"]["released"] is not None


def test_aembed_matches_embed_and_takes_token_ids(model: Model) -> None:
    text = model.embed("hello there")
    tokens = model.engines[0].tokenize_inputs(["hello there"])[0]  # type: ignore[attr-defined]
    by_ids = asyncio.run(model.aembed([tokens]))
    assert np.allclose(text.array, by_ids.array, atol=1e-5)


def test_bad_inputs_name_the_field(model: Model) -> None:
    for bad, field in [([], "input"), ([""], r"input\[0\]"), (["ok", 3], r"input\[1\]")]:
        with pytest.raises(InvalidArgument, match=field) as caught:
            model.embed(bad)  # type: ignore[arg-type]
        assert caught.value.param is not None
    long = "word " * 200
    with pytest.raises(InvalidArgument, match=r"input\[1\] has \d+ tokens .* at most 128"):
        model.embed(["short", long])
    cut = model.embed(["short", long], truncate=True)
    assert cut.usage.prompt_tokens == len(model.engines[0].tokenize_inputs(["short"])[0]) + 128  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match=r"input\[0\]: token 999999 is not in"):
        model.embed([[1, 999999]])


def test_rerank_on_a_model_without_rank_pooling_is_refused(model: Model) -> None:
    with pytest.raises(InvalidArgument, match="cannot rerank: its pooling is mean") as caught:
        model.rerank("what is the sea?", ["the sea is wide", "a cat"])
    assert caught.value.param == "model"


def test_a_big_request_cancelled_after_100_ms_releases_within_one_step(model: Model) -> None:
    stream = model.embeddings(["a short input"] * 2000)
    time.sleep(0.1)
    stream.cancel()
    assert stream.wait_released(NET)
    trace = stream.trace
    assert trace.end_reason is EndReason.USER_CANCEL
    assert trace.cancel_to_release is not None
    assert trace.cancel_to_release < 1.0
    with pytest.raises(Cancelled):
        stream.read()


def test_leaving_the_loop_stops_the_request(model: Model) -> None:
    with model.embeddings(["a short input"] * 2000) as stream:
        for chunk in stream:
            assert chunk.index == 0
            break
    assert stream.wait_released(NET)
    assert stream.end_reason is EndReason.USER_CANCEL


async def _first_then_cancel(model: Model) -> EndReason | None:
    stream = await asyncio.to_thread(model.embeddings, ["a short input"] * 2000)
    task = asyncio.ensure_future(stream.aread())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.await_released(NET)
    return stream.end_reason


def test_a_cancelled_task_stops_aembed(model: Model) -> None:
    assert asyncio.run(_first_then_cancel(model)) is EndReason.USER_CANCEL


def test_a_total_deadline_ends_it_total_timeout(model: Model) -> None:
    with pytest.raises(Cancelled) as caught:
        model.embed(["a short input"] * 2000, limits=Limits(total=0.2))
    assert caught.value.reason is EndReason.TOTAL_TIMEOUT


def test_a_first_result_deadline_ends_a_queued_request(model: Model) -> None:
    chats = [model.stream(prompt="Once", max_tokens=50, capacity=1) for _ in range(4)]
    try:
        with pytest.raises(Cancelled) as caught:
            model.embed(["x"], limits=Limits(first_token=0.2))
        assert caught.value.reason is EndReason.FIRST_TOKEN_TIMEOUT
    finally:
        for chat in chats:
            chat.cancel()
            chat.wait_released(NET)


def test_embeddings_wait_in_the_queue_and_a_full_queue_refuses(model: Model) -> None:
    # Four chat streams fill the four slots and wait on their unread belts.
    chats = [model.stream(prompt="Once", max_tokens=50, capacity=1) for _ in range(4)]
    try:
        queued = [model.embeddings(["x"]) for _ in range(2)]
        with pytest.raises(QueueFull):
            model.embeddings(["y"])
        assert model.statistics().queued == 2
        for chat in chats:
            chat.cancel()
        for q in queued:
            assert q.read().array.shape == (1, 576)
    finally:
        for chat in chats:
            chat.cancel()
            chat.wait_released(NET)


def test_chat_streams_keep_producing_while_a_batch_embeds(model: Model) -> None:
    chats = [
        model.stream(prompt=f"Story {i}:", max_tokens=16, temperature=0.0, capacity=64)
        for i in range(3)
    ]
    readers = [iter(chat) for chat in chats]
    firsts = [next(r) for r in readers]  # decoding before the batch comes
    batch = model.embeddings([f"input number {i}" for i in range(40)])
    stopped = model.embeddings(["never mind"] * 2000)
    stopped.cancel()
    texts = [first + "".join(r) for first, r in zip(firsts, readers, strict=True)]
    done = batch.read()
    assert stopped.wait_released(NET)
    assert done.array.shape == (40, 576)
    assert [chat.end_reason for chat in chats] == [EndReason.LENGTH] * 3
    assert all(texts)
    assert stopped.end_reason is EndReason.USER_CANCEL
    # The chat streams went on producing between the embedding's steps.
    first = done.trace.first_token
    assert first is not None
    assert all((c.trace.last_token or 0) > first for c in chats)
    gaps = [max(c.trace.token_gaps) for c in chats]
    print(
        f"max inter-token gap of 3 chat streams while embedding: {max(gaps) * 1000:.0f} ms",
        f"(embedding {done.trace.end_to_end:.2f} s, gaps {[round(g * 1000) for g in gaps]})",
    )


def test_a_model_without_embeddings_says_so(runtime: Runtime) -> None:
    scripted = runtime.add_engines("scripted-embed", [ScriptedEngine(["a"])])
    try:
        with pytest.raises(InvalidArgument, match="does not serve embeddings"):
            scripted.embed(["x"])
    finally:
        runtime.unload("scripted-embed")


def test_a_worker_process_embeds_what_this_process_does(model: Model) -> None:
    texts = ["a red apple", "the stock market fell"]
    here = model.embed(texts)
    with Runtime(keep_alive=None, n_ctx=128, slots=2, isolation="process") as rt:
        worker = rt.load(str(default_model_path()), load_timeout=120)
        there = worker.embed(texts)
        stream = worker.embeddings(["a short input"] * 2000)
        time.sleep(0.1)
        stream.cancel()
        assert stream.wait_released(NET)
    assert np.allclose(here.array, there.array, atol=1e-4)
    assert there.trace.worker is not None
    assert stream.end_reason is EndReason.USER_CANCEL


def test_a_catalog_entry_sets_kind_pooling_and_context(tokenbelt_home: Path) -> None:
    path = default_model_path()
    entry = {
        "alias": "smol-embed",
        "family": "smollm2",
        "license": "Apache-2.0",
        "context_length": 96,
        "kind": "embedding",
        "pooling": "last",
        "variants": [
            {
                "id": "smol-embed-cpu",
                "device": "cpu",
                "size": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "source": {"type": "path", "path": str(path)},
            }
        ],
    }
    catalog = Home.from_env().catalog_file
    catalog.parent.mkdir(parents=True, exist_ok=True)
    catalog.write_text(json.dumps({"version": 1, "models": [entry]}))
    with Runtime(keep_alive=None, slots=1) as rt:  # n_ctx 4096: more than the entry's
        model = rt.load("smol-embed", load_timeout=120)
        info = model.embedding_info()
        assert (info.pooling, info.pooling_source, info.max_tokens) == ("last", "catalog", 96)
        assert model.info["kind"] == "embedding"
        assert model.embed("hello").dimension == 576
        with pytest.raises(InvalidArgument, match="is an embedding model: it does not generate"):
            model.complete("hello")
