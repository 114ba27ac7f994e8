"""``POST /v1/embeddings`` (OpenAI) and ``POST /v1/rerank`` (the Jina and Cohere shape,
also at ``/rerank``), on the request path every generation takes.

An embedding answer's vectors are unit length (floats, or base64 of little-endian
float32 with ``encoding_format: "base64"``, what the ``openai`` client asks for by
default). ``dimensions`` cuts them (Matryoshka, renormalised) only for a model whose
catalog entry lists the sizes it was trained for; elsewhere it is a 400. An input
longer than the model embeds is a 400 naming it, unless ``truncate`` (a tokenbelt
extension) asks to cut it. A rerank on a model that is not a reranker (pooling
``rank``) is a 400: an embedding or chat model has no relevance scores to give.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ...runtime import Embeddings
from ..core import (
    Serving,
    TokenbeltOptions,
    UnsupportedParameter,
    answer_embedding,
    check_dimensions,
    encode_vector,
    openai_shape,
    shrink,
    submit_embedding,
    tokenbelt_final,
)

API = "openai"

router = APIRouter()


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body (``input`` is checked by the runtime, naming the item)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field("", max_length=200)
    input: Any = Field(
        ..., description="a string, a list of strings, a token-id list, or a list of those"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None, description="cut vectors to this size (only models trained for it)"
    )
    user: str | None = Field(None, max_length=256, description="accepted, not used")
    truncate: bool = Field(
        False, description="tokenbelt: cut an input longer than the model embeds"
    )
    tokenbelt: TokenbeltOptions | None = None

    def inputs(self) -> list[Any]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if (
            isinstance(value, list)
            and value
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        ):
            return [value]  # one token-id list
        return value  # type: ignore[no-any-return]


class RerankRequest(BaseModel):
    """The Jina and Cohere rerank body: ``query``, ``documents`` (strings, or objects
    with ``text``), ``top_n``, ``return_documents``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field("", max_length=200)
    query: Any
    documents: Any
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    truncate: bool = Field(False, description="tokenbelt: cut a pair longer than the model takes")
    max_tokens_per_doc: int | None = Field(
        None,
        ge=1,
        description="Cohere's: cut long documents; at least the model's window (then a pair "
        "longer than the model takes is cut, as with truncate)",
    )
    tokenbelt: TokenbeltOptions | None = None

    def cuts(self, window: int) -> bool:
        """Whether a pair longer than the model takes is cut (``truncate``, or Cohere's
        ``max_tokens_per_doc``); ``UnsupportedParameter`` for a count below ``window``."""
        most = self.max_tokens_per_doc
        if most is not None and most < window:
            raise UnsupportedParameter(
                "max_tokens_per_doc",
                f"tokenbelt cuts a query and document pair at the model's window ({window} "
                f"tokens), not a document at {most}: send {window} or more, or shorter documents",
            )
        return self.truncate or most is not None

    def texts(self) -> Any:
        docs = self.documents
        if isinstance(docs, list):
            return [d["text"] if isinstance(d, dict) and "text" in d else d for d in docs]
        return docs


@router.post("/v1/embeddings", summary="Embeddings of one input or many (OpenAI)")
async def embeddings(body: EmbeddingRequest, path: Serving) -> Response:
    model = path.state.model_for(body.model)
    check_dimensions(model, body.dimensions)
    inputs = body.inputs()

    def make(**queue: Any) -> Any:
        return model.embeddings(inputs, truncate=body.truncate, **queue)

    stream = await submit_embedding(path, model, make, body.tokenbelt, api=API)

    def render(done: Embeddings) -> dict[str, Any]:
        rows = shrink(done.array, body.dimensions)
        return {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": encode_vector(row, body.encoding_format),
                }
                for i, row in enumerate(rows)
            ],
            "model": model.name,
            "usage": {
                "prompt_tokens": done.usage.prompt_tokens,
                "total_tokens": done.usage.prompt_tokens,
            },
            "tokenbelt": tokenbelt_final(stream),
        }

    return answer_embedding(stream, render, shape=openai_shape)


@router.post("/v1/rerank", summary="Rerank documents against a query (Jina and Cohere shape)")
@router.post("/v2/rerank", summary="Rerank documents against a query (Cohere v2's path)")
@router.post("/rerank", summary="Rerank documents against a query (alias of /v1/rerank)")
async def rerank(body: RerankRequest, path: Serving) -> Response:
    model = path.state.model_for(body.model)
    documents = body.texts()
    truncate = body.cuts(model.context_length)

    def make(**queue: Any) -> Any:
        return model.reranking(body.query, documents, truncate=truncate, **queue)

    stream = await submit_embedding(path, model, make, body.tokenbelt, api=API)

    def render(done: Embeddings) -> dict[str, Any]:
        scores = [float(row[0]) for row in done.array]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
        results = []
        for i in order:
            entry: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                entry["document"] = {"text": documents[i]}
            results.append(entry)
        return {
            "model": model.name,
            "results": results,
            "usage": {
                "prompt_tokens": done.usage.prompt_tokens,
                "total_tokens": done.usage.prompt_tokens,
            },
            "tokenbelt": tokenbelt_final(stream),
        }

    return answer_embedding(stream, render, shape=openai_shape)
