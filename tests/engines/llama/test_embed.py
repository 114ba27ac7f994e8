"""Embeddings from the batch engine's second context, on the same loaded weights, in
this process and through the worker process: vectors, packing, stops.

One engine of each kind is loaded for the module on the real default model (a chat
model: its GGUF names no pooling, so the engine pools by ``mean``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tokenbelt import EndReason, GenerationRequest, InvalidArgument, SamplingParams
from tokenbelt.belt import Belt
from tokenbelt.engines import BatchEngine, WorkerEngine
from tokenbelt.engines._embedding import Embedded, EmbeddingRequest
from tokenbelt.models import default_model_path

pytestmark = pytest.mark.model

NET = 60.0


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    path = default_model_path()
    made: Any = (
        BatchEngine(path, slots=2, n_ctx=512)
        if request.param == "thread"
        else WorkerEngine.load(path, slots=2, n_ctx=512)
    )
    try:
        yield made
    finally:
        made.close()


def embed_request(engine: Any, texts: list[str]) -> EmbeddingRequest:
    return EmbeddingRequest(tuple(tuple(t) for t in engine.tokenize_inputs(texts)))


def start(engine: Any, request: Any, capacity: int = 16) -> Belt[Any]:
    belt: Belt[Any] = Belt(capacity)
    belt.trace.mark_enqueued()
    engine.count_prompt_tokens(request)
    engine.start(request, belt.producer)
    return belt


def vectors(belt: Belt[Any]) -> np.ndarray:
    items: list[Embedded] = list(belt)
    assert belt.wait_released(NET)
    assert [i.index for i in items] == sorted(i.index for i in items)
    return np.concatenate([i.vectors for i in items])


def test_vectors_are_unit_length_of_the_models_size_and_follow_the_text(engine: Any) -> None:
    info = engine.embedding_info()
    assert (info.dimension, info.pooling, info.pooling_source) == (576, "mean", "default")
    texts = ["the cat sat on the mat", "the cat sat on the mat", "quantum chromodynamics"]
    belt = start(engine, embed_request(engine, texts))
    v = vectors(belt)
    assert belt.end_reason is EndReason.STOP
    assert v.shape == (3, 576)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    # The same text twice in one batch: the same vector but for the last bits (the CPU's
    # matrix kernels sum a row by where it sits in the batch).
    assert np.allclose(v[0], v[1], atol=1e-4)
    assert float(v[0] @ v[2]) < 0.99
    assert belt.trace.prompt_tokens == sum(len(t) for t in engine.tokenize_inputs(texts))


def test_many_inputs_are_packed_into_ubatches_in_order(engine: Any) -> None:
    texts = [f"sentence number {i}" for i in range(70)]
    one = vectors(start(engine, embed_request(engine, texts[7:8])))
    belt = start(engine, embed_request(engine, texts), capacity=4)
    items: list[Embedded] = list(belt)
    assert belt.wait_released(NET)
    assert len(items) >= 2  # at most 64 inputs a ubatch
    assert sum(len(i.vectors) for i in items) == 70
    assert items[0].index == 0
    all_of = np.concatenate([i.vectors for i in items])
    # packed beside others or alone, an input's vector is its own
    assert np.allclose(all_of[7], one[0], atol=1e-4)


def test_a_stop_releases_a_large_request_within_one_ubatch(engine: Any) -> None:
    request = embed_request(engine, ["a short input"] * 2000)
    belt = start(engine, request, capacity=4)
    time.sleep(0.1)
    stopped = time.monotonic()
    belt.cancel(EndReason.USER_CANCEL)
    assert belt.wait_released(NET)
    lag = time.monotonic() - stopped
    assert belt.end_reason is EndReason.USER_CANCEL
    assert belt.statistics().produced < 2000 / 64
    assert lag < 2.0, f"released {lag:.2f} s after the stop"
    assert engine.statistics().running == 0


def test_embeddings_and_chat_share_the_engine(engine: Any) -> None:
    chat = GenerationRequest(prompt="Once upon a time", sampling=SamplingParams(max_tokens=8))
    talk = start(engine, chat)
    belt = start(engine, embed_request(engine, ["hello"] * 10))
    assert vectors(belt).shape == (10, 576)
    text = "".join(talk)
    assert talk.end_reason is EndReason.LENGTH
    assert text
    assert talk.wait_released(NET)


def test_bad_requests_are_refused_before_queueing(engine: Any) -> None:
    with pytest.raises(InvalidArgument, match="input is empty"):
        engine.count_prompt_tokens(EmbeddingRequest(()))
    with pytest.raises(InvalidArgument, match=r"input\[1\] has no tokens"):
        engine.count_prompt_tokens(EmbeddingRequest(((1, 2), ())))
    long = tuple(range(1, 600))
    with pytest.raises(InvalidArgument, match=r"input\[0\] has 599 tokens .* at most 512"):
        engine.count_prompt_tokens(EmbeddingRequest((long,)))


def test_the_abort_hook_stops_a_ubatch_in_flight() -> None:
    engine = BatchEngine(default_model_path(), slots=1, n_ctx=512)
    try:
        embedder = engine._embedder
        # Long inputs: each ubatch computes 512 tokens.
        request = EmbeddingRequest(tuple(tuple(range(100, 356)) for _ in range(40)))
        belt = start(engine, request)
        deadline = time.monotonic() + NET
        while not embedder._in_flight and time.monotonic() < deadline:
            time.sleep(0.001)
        belt.cancel(EndReason.USER_CANCEL)
        assert belt.wait_released(NET)
        assert embedder.aborted >= 1
        assert belt.end_reason is EndReason.USER_CANCEL
        # Closing the engine ends a running request shutdown, and releases it.
        running = start(engine, request)
        deadline = time.monotonic() + NET
        while not embedder._in_flight and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        engine.close()
    assert running.wait_released(NET)
    assert running.end_reason is EndReason.SHUTDOWN


def test_a_pooling_override_is_used_and_an_unknown_one_refused() -> None:
    engine = BatchEngine(default_model_path(), slots=1, n_ctx=256, pooling="last")
    try:
        info = engine.embedding_info()
        assert (info.pooling, info.pooling_source) == ("last", "catalog")
        texts = ["the cat sat on the mat"]
        last = vectors(start(engine, embed_request(engine, texts)))
    finally:
        engine.close()
    mean_engine = BatchEngine(default_model_path(), slots=1, n_ctx=256)
    try:
        mean = vectors(start(mean_engine, embed_request(mean_engine, texts)))
    finally:
        mean_engine.close()
    assert not np.allclose(last, mean, atol=1e-3)
    with pytest.raises(InvalidArgument, match="pooling must be one of"):
        BatchEngine(default_model_path(), slots=1, n_ctx=256, pooling="max")
    # A chat model has no classification head: rank pooling would give meaningless scores.
    for make in (BatchEngine, WorkerEngine):
        with pytest.raises(InvalidArgument, match="no classification head"):
            make(default_model_path(), slots=1, n_ctx=256, pooling="rank")
