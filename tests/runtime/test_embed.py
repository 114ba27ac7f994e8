"""Embeddings and rerank through the SDK: the same admission queue, deadlines, stops,
traces and end reasons as chat, beside chat on the same loaded model.

One runtime and the real default model (a chat model, pooled by ``mean``) for the
module; inputs are short so every test stays quick. Rerank runs on a test reranker made
from that model (``tests/rerankers.py``: a qwen3 GGUF with a classification head whose
scores are ``sigmoid(w . h)``, ``h`` a pair's last hidden state): its scores are no
relevance, but each one can be computed from that file pooled by ``last``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from rerankers import as_reranker, sigmoid
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
from tokenbelt.engines import BatchEngine
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


# -- rerank on a reranker (tests/rerankers.py) ------------------------------------------------

QUERY = "what is the sea?"
#: documents of different lengths, the first one twice
DOCUMENTS = ["the sea is wide", "a cat", "tax forms are due in April", "waves", "the sea is wide"]
#: how far a pair's logit may move with its place in a ubatch: llama.cpp's CPU kernels
#: are not bit-identical across ubatch layouts (about 0.01 seen; the documents' logits
#: lie more than 0.2 apart, which the tests check)
LAYOUT_SLACK = 0.05


@dataclass(frozen=True)
class Reranker:
    #: the test reranker as its GGUF says: pooling rank
    model: Model
    #: the same file pooled by ``last``: each input's last hidden state, unnormalised
    last: Model
    #: the head's scoring row ``w``: a pair's score is ``sigmoid(w . h)``
    head: np.ndarray


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reranker]:
    path = tmp_path_factory.mktemp("reranker") / "smollm2-rank.gguf"
    head = as_reranker(Path(default_model_path()), path)
    # One thread: the thread tuner's trial of two on a busy two-core machine took seconds.
    with Runtime(keep_alive=None, n_ctx=256, slots=1, n_threads=1, n_threads_batch=1) as rt:
        model = rt.load(str(path), load_timeout=120)
        last = rt.add_engines(
            "smollm2-rank-last",
            lambda: [
                BatchEngine(
                    path, pooling="last", n_ctx=256, slots=1, n_threads=1, n_threads_batch=1
                )
            ],
        )
        yield Reranker(model, last, head)


def pairs_of(reranker: Reranker, documents: Sequence[str]) -> list[list[int]]:
    return reranker.model.engines[0].tokenize_pairs(QUERY, documents)  # type: ignore[attr-defined, no-any-return]


def logit(scores: np.ndarray) -> np.ndarray:
    p = scores.astype(np.float64)
    return np.asarray(np.log(p) - np.log1p(-p))


def test_a_reranker_scores_each_pair_by_its_head_on_that_pairs_last_hidden_state(
    reranker: Reranker,
) -> None:
    """Every score is the head applied to its own pair's hidden state, in a batch of pairs
    of different lengths: no score comes from another pair's sequence."""
    info = reranker.model.embedding_info()
    assert (info.pooling, info.pooling_source, info.dimension) == ("rank", "gguf", 2)
    pairs = pairs_of(reranker, DOCUMENTS)
    # This vocabulary adds no BOS, EOS or SEP: a pair is the query's tokens, the document's.
    tokens = reranker.model.engines[0].tokenize_inputs  # type: ignore[attr-defined]
    (query,) = tokens([QUERY])
    assert pairs == [query + t for t in tokens(DOCUMENTS)]
    assert len({len(p) for p in pairs}) == 4
    rows = reranker.model.reranking(QUERY, DOCUMENTS).read().array
    assert rows.shape == (5, 2)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-6)  # a softmax of two outputs
    # The same pairs in one request pooled by last: the same ubatch, the same layout.
    hidden = reranker.last.embed(pairs, normalize=False).array
    assert hidden.shape == (5, 576)
    assert np.linalg.norm(hidden, axis=1).min() > 2  # not unit length: normalize=False held
    np.testing.assert_allclose(rows[:, 0], sigmoid(hidden @ reranker.head), rtol=1e-5, atol=1e-6)
    # Each pair alone (one sequence, no packing) gives its own score, up to the layout.
    alone = np.array(
        [reranker.last.embed([p], normalize=False).array[0] @ reranker.head for p in pairs]
    )
    np.testing.assert_allclose(logit(rows[:, 0]), alone, atol=LAYOUT_SLACK)
    distinct = alone[:4]
    gaps = np.abs(distinct[:, None] - distinct[None, :])[np.triu_indices(4, 1)]
    assert gaps.min() > 4 * LAYOUT_SLACK, alone  # a mixed-up pair could not pass


def test_rerank_lists_the_documents_best_first_each_naming_its_own(reranker: Reranker) -> None:
    """Results best first, each result's index, score and text its own document's; top_n
    keeps the best; usage counts every pair's tokens; the async call agrees."""
    model = reranker.model
    pairs = pairs_of(reranker, DOCUMENTS)
    ranked = model.rerank(QUERY, DOCUMENTS)
    results = ranked.results
    assert sorted(r.index for r in results) == list(range(5))
    assert [r.score for r in results] == sorted((r.score for r in results), reverse=True)
    assert [r.document for r in results] == [DOCUMENTS[r.index] for r in results]
    # Each score is its own document's: the head on that pair's hidden state.
    hidden = reranker.last.embed(pairs, normalize=False).array
    expected = sigmoid(hidden @ reranker.head)
    for r in results:
        assert r.score == pytest.approx(float(expected[r.index]), rel=1e-5)
    # The same pair twice: the same score, up to its place in the ubatch.
    by_index = {r.index: r.score for r in results}
    twice = logit(np.array([by_index[0], by_index[4]]))
    assert float(twice[0]) == pytest.approx(float(twice[1]), abs=LAYOUT_SLACK)
    assert ranked.usage.prompt_tokens == sum(len(p) for p in pairs)
    trace = ranked.trace.to_dict()
    assert (trace["kind"], trace["inputs"], trace["end_reason"]) == ("rerank", 5, "stop")
    top = asyncio.run(model.arerank(QUERY, DOCUMENTS, top_n=2))
    assert [(r.index, r.document) for r in top.results] == [
        (r.index, r.document) for r in results[:2]
    ]
    assert [r.score for r in top.results] == pytest.approx([r.score for r in results[:2]])
    assert top.usage.prompt_tokens == ranked.usage.prompt_tokens  # every pair was scored
    with pytest.raises(InvalidArgument, match="top_n must be a positive integer") as caught:
        model.rerank(QUERY, DOCUMENTS, top_n=0)
    assert caught.value.param == "top_n"


def test_a_reranker_refuses_embeddings_and_pairs_too_long(reranker: Reranker) -> None:
    """Embeddings from a reranker are refused, naming rerank; so is a pair past its limit."""
    for ask in (lambda: reranker.model.embed("the sea"), lambda: reranker.model.embeddings(["x"])):
        with pytest.raises(InvalidArgument, match=r"a reranker \(pooling rank\).*use rerank") as c:
            ask()
        assert c.value.param == "model"
    with pytest.raises(InvalidArgument, match=r"documents\[1\] has \d+ tokens .* at most 256"):
        reranker.model.rerank(QUERY, ["short", "word " * 300])
    assert reranker.model.statistics().queued == 0
