"""``/v1/embeddings`` and ``/v1/rerank`` over real HTTP, driven by the ``openai`` client
and httpx: vectors, refusals naming the field, and the request path every generation
takes (deadlines, disconnect, cancel, the bounded queue, ``/v1/requests``).

One server for the module with the real default model (a chat model: pooled by mean,
no rank pooling, no Matryoshka sizes); rerank's answers come from a server of its own
on a test reranker made from that model (``tests/rerankers.py``).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import openai
import pytest

import plainhttp
from rerankers import as_reranker
from tokenbelt import Runtime
from tokenbelt.models import default_model_path

from ..conftest import NET, Served, ServeFactory, SharedServer, real_runtime, shared_server

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    # A small context: an input holds at most 128 tokens, so the longest test input is quick.
    with shared_server(lambda: real_runtime(n_ctx=128, slots=4, queue_size=2)) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


def post(served: Served, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return plainhttp.post(f"{served.url}{path}", json=body, timeout=NET, **kwargs)


def record(served: Served, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + NET
    while True:
        got: dict[str, Any] = plainhttp.get(
            f"{served.url}/v1/requests/{request_id}", timeout=NET
        ).json()
        if got.get("timeline_ms", {}).get("released") is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{request_id} was not released: {got}")
        time.sleep(0.02)


def test_the_openai_client_embeds_one_and_many(client: openai.OpenAI, served: Served) -> None:
    name = served.model().name
    one = client.embeddings.create(model=name, input="the sea is wide")  # base64 by default
    many = client.embeddings.create(
        model=name,
        input=["the sea is wide", "the sea is wide", "tax forms are due in April"],
        encoding_format="float",
    )
    assert len(one.data) == 1
    assert len(one.data[0].embedding) == 576
    vectors = np.array([d.embedding for d in many.data])
    assert [d.index for d in many.data] == [0, 1, 2]
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert np.allclose(vectors[0], vectors[1], atol=1e-4)  # the same text, but the last bits
    assert not np.allclose(vectors[0], vectors[2], atol=1e-3)
    assert np.allclose(vectors[0], one.data[0].embedding, atol=1e-5)
    assert many.usage.prompt_tokens == many.usage.total_tokens > 3
    by_ids = client.embeddings.create(model=name, input=[[1, 2, 3], [4, 5]])
    assert len(by_ids.data) == 2


def test_base64_is_little_endian_float32(served: Served) -> None:
    body = {"model": served.model().name, "input": "hello", "encoding_format": "base64"}
    r = post(served, "/v1/embeddings", body)
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    vector = np.frombuffer(raw, dtype="<f4")
    floats = post(served, "/v1/embeddings", {**body, "encoding_format": "float"}).json()
    assert np.allclose(vector, floats["data"][0]["embedding"], atol=1e-6)
    trace = record(served, r.headers["x-request-id"])
    assert (trace["kind"], trace["inputs"], trace["end_reason"]) == ("embed", 1, "stop")


def test_float_vectors_are_written_in_their_shortest_float32_form(served: Served) -> None:
    sdk = served.model().embed(["hello"]).array[0]
    r = post(served, "/v1/embeddings", {"model": served.model().name, "input": "hello"})
    assert r.status_code == 200, r.text
    written = r.json()["data"][0]["embedding"]
    # Read back as float32, each number is the very float32 the model made ...
    assert np.array_equal(np.asarray(written, dtype=np.float32), sdk)
    # ... and is written no longer than it takes to say so (not 17 digits of a double).
    numbers = r.text.split('"embedding":[', 1)[1].split("]", 1)[0].split(",")
    assert max(len(n) for n in numbers) <= 15, max(numbers, key=len)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input[0]"),
        ({"input": ["ok", 3]}, "input[1]"),
        ({"input": ["ok", "word " * 200]}, "input[1]"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": [[1, 10**9]]}, "input[0]"),
        ({"input": "hi", "colour": "red"}, "colour"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    served: Served, body: dict[str, Any], param: str
) -> None:
    r = post(served, "/v1/embeddings", {"model": served.model().name, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert served.recorder.enqueued() == []


def test_truncate_cuts_an_input_that_is_too_long(served: Served) -> None:
    body = {"model": served.model().name, "input": ["word " * 200], "truncate": True}
    r = post(served, "/v1/embeddings", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 128


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_on_a_model_that_is_no_reranker_is_a_400(served: Served, path: str) -> None:
    body = {"model": served.model().name, "query": "sea", "documents": ["the sea", "a cat"]}
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model"
    assert "cannot rerank: its pooling is mean" in error["message"]


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reranker") / "smollm2-rank.gguf"
    as_reranker(Path(default_model_path()), path)
    return path


def test_a_reranker_answers_both_rerank_routes_best_first_as_the_sdk_does(
    serve: ServeFactory, reranker_path: Path
) -> None:
    """/v1/rerank and /rerank give the SDK's scores, best first, each naming its document;
    top_n and return_documents are honoured; embeddings from a reranker are a 400."""
    # One thread: the thread tuner's trial of two on a busy two-core machine took seconds.
    served = serve(Runtime(keep_alive=None, n_ctx=256, slots=1, n_threads=1, n_threads_batch=1))
    model = served.runtime.load(str(reranker_path), load_timeout=120)
    query = "what is the sea?"
    documents = ["the sea is wide", "a cat", "tax forms are due in April", "waves"]
    sdk = model.rerank(query, documents)
    r = post(served, "/v1/rerank", {"model": model.name, "query": query, "documents": documents})
    assert r.status_code == 200, r.text
    answer = r.json()
    results = answer["results"]
    assert [x["index"] for x in results] == [x.index for x in sdk.results]
    assert [x["relevance_score"] for x in results] == pytest.approx(
        [x.score for x in sdk.results], rel=1e-6
    )
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert len(set(scores)) == 4
    assert [x["document"]["text"] for x in results] == [documents[x["index"]] for x in results]
    assert answer["model"] == model.name
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"]
    assert answer["usage"]["prompt_tokens"] == sdk.usage.prompt_tokens
    trace = record(served, r.headers["x-request-id"])
    assert (trace["kind"], trace["inputs"], trace["end_reason"]) == ("rerank", 4, "stop")
    body = {
        "model": model.name,
        "query": query,
        "documents": [{"text": d} for d in documents],  # Cohere's document objects
        "top_n": 2,
        "return_documents": False,
    }
    r = post(served, "/rerank", body)
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in results[:2]]
    assert [x["relevance_score"] for x in top] == pytest.approx(scores[:2], rel=1e-6)
    assert all("document" not in x for x in top)
    r = post(served, "/v1/embeddings", {"model": model.name, "input": "the sea"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model"
    assert "this model is a reranker (pooling rank)" in error["message"]
    # Cohere's own SDKs: v2 posts /v2/rerank, v1 /v1/rerank; the same order either way.
    with httpx.Client(timeout=NET) as http:
        v2 = cohere.ClientV2(api_key="x", base_url=served.url, httpx_client=http)
        ranked = v2.rerank(model=model.name, query=query, documents=documents, top_n=3)
        assert [x.index for x in ranked.results] == [x.index for x in sdk.results[:3]]
        assert [x.relevance_score for x in ranked.results] == pytest.approx(scores[:3], rel=1e-6)
        window = model.context_length
        long = [*documents, "the sea " * 400]  # past the model's window: cut, as Cohere does
        cut = v2.rerank(model=model.name, query=query, documents=long, max_tokens_per_doc=window)
        assert len(cut.results) == 5
        with pytest.raises(cohere.BadRequestError, match="max_tokens_per_doc"):
            v2.rerank(model=model.name, query=query, documents=documents, max_tokens_per_doc=8)
        v1 = cohere.Client(api_key="x", base_url=served.url, httpx_client=http)
        old = v1.rerank(model=model.name, query=query, documents=documents, top_n=1)
        assert old.results[0].index == sdk.results[0].index


def test_a_total_deadline_is_a_504_total_timeout(served: Served) -> None:
    body = {
        "model": served.model().name,
        "input": ["a short input"] * 2000,
        "tokenbelt": {"total_timeout": 0.2},
    }
    r = post(served, "/v1/embeddings", body)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "total_timeout"
    assert record(served, r.headers["x-request-id"])["end_reason"] == "total_timeout"


def test_a_disconnect_ends_it_client_disconnect(served: Served) -> None:
    body = {"model": served.model().name, "input": ["a short input"] * 2000}
    with pytest.raises(httpx.ReadTimeout):
        plainhttp.post(
            f"{served.url}/v1/embeddings",
            json=body,
            headers={"x-request-id": "embed-gone-1"},
            timeout=httpx.Timeout(NET, read=0.3),
        )
    trace = record(served, "embed-gone-1")
    assert trace["end_reason"] == "client_disconnect"
    assert trace["cancel_to_release_ms"] < 2000


def test_a_cancel_through_v1_requests_is_a_409_user_cancel(served: Served) -> None:
    body = {"model": served.model().name, "input": ["a short input"] * 2000}
    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(
            post(served, "/v1/embeddings", body, headers={"x-request-id": "embed-stop-1"})
        )
    )
    thread.start()
    deadline = time.monotonic() + NET
    while True:
        r = plainhttp.post(f"{served.url}/v1/requests/embed-stop-1/cancel", timeout=NET)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    thread.join(NET)
    assert answers[0].status_code == 409, answers[0].text
    assert answers[0].json()["error"]["code"] == "user_cancel"
    assert record(served, "embed-stop-1")["end_reason"] == "user_cancel"


def test_embeddings_take_the_bounded_queue_and_a_full_one_is_a_429(served: Served) -> None:
    model = served.model()
    chats = [model.stream(prompt="Once", max_tokens=50, capacity=1) for _ in range(4)]
    try:
        queued = [model.embeddings(["x"]) for _ in range(2)]
        r = post(served, "/v1/embeddings", {"model": model.name, "input": "y"})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "queue_full"
        for chat in chats:
            chat.cancel()
        for q in queued:
            assert q.read().array.shape == (1, 576)
    finally:
        for chat in chats:
            chat.cancel()
            chat.wait_released(NET)


def test_metrics_count_embedding_inputs_and_tokens(served: Served) -> None:
    r = post(served, "/v1/embeddings", {"model": served.model().name, "input": ["a", "b"]})
    assert r.status_code == 200
    record(served, r.headers["x-request-id"])
    text = plainhttp.get(f"{served.url}/metrics", timeout=NET).text
    assert 'tokenbelt_embedding_inputs_total{api="openai",kind="embed"' in text
    assert "tokenbelt_embedding_tokens_total" in text
    assert "tokenbelt_embedding_seconds_bucket" in text


def test_the_routes_are_in_the_openapi_document(served: Served) -> None:
    paths = plainhttp.get(f"{served.url}/openapi.json", timeout=NET).json()["paths"]
    for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/api/embed", "/api/embeddings"):
        answers = paths[path]["post"]["responses"]
        assert {"200", "400", "429", "504"} <= set(answers), path


def test_dimensions_cut_and_renormalise_for_a_model_trained_for_it(served: Served) -> None:
    model = served.model()
    model.info["matryoshka"] = [576, 128]  # as a catalog entry's ``matryoshka`` sets it
    try:
        body = {"model": model.name, "input": "the sea is wide", "encoding_format": "float"}
        full = np.array(post(served, "/v1/embeddings", body).json()["data"][0]["embedding"])
        r = post(served, "/v1/embeddings", {**body, "dimensions": 128})
        assert r.status_code == 200, r.text
        cut = np.array(r.json()["data"][0]["embedding"])
        assert cut.shape == (128,)
        assert np.allclose(cut, full[:128] / np.linalg.norm(full[:128]), atol=1e-5)
        refused = post(served, "/v1/embeddings", {**body, "dimensions": 100})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "dimensions"
        assert "may be cut to 576, 128" in refused.json()["error"]["message"]
        ollama = post(served, "/api/embed", {"model": model.name, "input": "x", "dimensions": 128})
        assert len(ollama.json()["embeddings"][0]) == 128
    finally:
        del model.info["matryoshka"]
