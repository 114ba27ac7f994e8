"""Embedding and rerank requests as the SDK hands them out.

``prepare_inputs`` turns texts (or token ids) into an ``EmbeddingRequest`` with the
model's own tokenizer, checking each input's length (truncating when asked) before
anything queues. The request then goes through the model's admission queue like a
chat request; ``EmbeddingStream`` is the caller's handle: iterate it for the vectors
as each engine step finishes them, or ``read()``/``aread()`` them all; ``cancel()``,
``close()``, a ``break`` or a cancelled task stops the engine between ubatches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._errors import Cancelled, EndOfStream, IllegalState, InvalidArgument
from ..belt import Belt, EndReason, Limits, Trace
from ..engines import Embedded, EmbeddingInfo, EmbeddingRequest, Embeds
from ._stream import OnBelt, Usage
from ._surface import EngineCalls

#: the most inputs one embedding request may carry
MAX_INPUTS = 4096

TextOrTokens = str | Sequence[int]


def check_texts(texts: Sequence[Any], field_name: str = "input") -> None:
    """Refuse an empty list, a non-string item or an empty string (``InvalidArgument``
    naming ``field_name`` and the index); token-id lists are checked by the tokenizer."""
    if isinstance(texts, str | bytes) or not isinstance(texts, Sequence):
        raise InvalidArgument(
            f"{field_name} must be a list of strings, got {type(texts).__name__}",
            param=field_name,
        )
    if not texts:
        raise InvalidArgument(f"{field_name} is empty: give at least one text", param=field_name)
    if len(texts) > MAX_INPUTS:
        raise InvalidArgument(
            f"{field_name} has {len(texts)} items; at most {MAX_INPUTS} per request",
            param=field_name,
        )
    for i, text in enumerate(texts):
        where = f"{field_name}[{i}]"
        if isinstance(text, str):
            if not text:
                raise InvalidArgument(f"{where} is an empty string", param=where)
        elif isinstance(text, Sequence) and not isinstance(text, bytes):
            if not text:
                raise InvalidArgument(f"{where} is an empty list of token ids", param=where)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in text):
                raise InvalidArgument(f"{where} must hold only token ids (integers)", param=where)
        else:
            raise InvalidArgument(
                f"{where} must be a string (or a list of token ids), got {type(text).__name__}",
                param=where,
            )


def _fit(
    tokens: list[int], info: EmbeddingInfo, truncate: bool, where: str, window: int | None = None
) -> tuple[int, ...]:
    """``tokens`` within the model's input limit, and within ``window`` where the request
    set a smaller one; cut there with ``truncate``, else ``InvalidArgument``."""
    limit = info.max_tokens if window is None else min(window, info.max_tokens)
    if len(tokens) <= limit:
        return tuple(tokens)
    if truncate:
        return tuple(tokens[:limit])
    what = "this model embeds" if limit == info.max_tokens else "this request's window holds"
    raise InvalidArgument(
        f"{where} has {len(tokens)} tokens but {what} at most {limit}; "
        "shorten it or ask for truncation",
        param=where,
    )


def prepare_inputs(
    engine: Embeds,
    texts: Sequence[TextOrTokens],
    *,
    truncate: bool,
    normalize: bool,
    field_name: str = "input",
    window: int | None = None,
) -> EmbeddingRequest:
    """Tokenize ``texts`` for ``engine`` (token-id lists are taken as they are, checked
    against the vocabulary); raises ``InvalidArgument`` naming the input at fault."""
    check_texts(texts, field_name)
    info = engine.embedding_info()
    if info.pooling == "rank":
        raise InvalidArgument(
            "this model is a reranker (pooling rank): it scores query-document pairs; "
            "use rerank, not embeddings",
            param="model",
        )
    strings = [t for t in texts if isinstance(t, str)]
    tokenized = iter(engine.tokenize_inputs(strings)) if strings else iter(())
    inputs = []
    for i, text in enumerate(texts):
        where = f"{field_name}[{i}]"
        if isinstance(text, str):
            tokens = next(tokenized)
        else:
            tokens = list(text)
            bad = [t for t in tokens if not 0 <= t < info.vocab_size]
            if bad:
                raise InvalidArgument(
                    f"{where}: token {bad[0]} is not in the vocabulary "
                    f"(ids 0 to {info.vocab_size - 1})",
                    param=where,
                )
        if not tokens:
            raise InvalidArgument(f"{where} has no tokens", param=where)
        inputs.append(_fit(tokens, info, truncate, where, window))
    return EmbeddingRequest(tuple(inputs), normalize=normalize)


def prepare_pairs(
    engine: Embeds, query: str, documents: Sequence[str], *, truncate: bool
) -> EmbeddingRequest:
    """The (query, document) pairs of a rerank for ``engine``; ``InvalidArgument`` for a
    model that is not a reranker, an empty query, or a bad document list."""
    info = engine.embedding_info()
    if info.pooling != "rank":
        raise InvalidArgument(
            f"this model cannot rerank: its pooling is {info.pooling} ({info.pooling_source}), "
            "not rank; load a reranker model (a GGUF with pooling_type rank)",
            param="model",
        )
    if not isinstance(query, str) or not query:
        raise InvalidArgument("query must be a non-empty string", param="query")
    check_texts(documents, "documents")
    if not all(isinstance(d, str) for d in documents):
        raise InvalidArgument("documents must be strings", param="documents")
    pairs = engine.tokenize_pairs(query, list(documents))
    inputs = tuple(
        _fit(tokens, info, truncate, f"documents[{i}]") for i, tokens in enumerate(pairs)
    )
    return EmbeddingRequest(inputs, normalize=False)


@dataclass(frozen=True)
class Embeddings:
    """A finished embedding request: one vector per input, in input order.

    ``array`` is a float32 numpy array (inputs x dimension); ``vectors`` the same as
    lists of floats."""

    array: Any
    usage: Usage
    trace: Trace
    end_reason: EndReason

    @property
    def vectors(self) -> list[list[float]]:
        return [[float(x) for x in row] for row in self.array]

    @property
    def dimension(self) -> int:
        return int(self.array.shape[1]) if self.array.ndim == 2 else 0

    def __len__(self) -> int:
        return int(self.array.shape[0])


@dataclass(frozen=True)
class Ranked:
    """One document of a rerank: its index in the request, its score, its text."""

    index: int
    score: float
    document: str


@dataclass(frozen=True)
class Ranking:
    """A finished rerank: documents best first (the model's raw relevance scores)."""

    results: tuple[Ranked, ...]
    usage: Usage
    trace: Trace
    end_reason: EndReason = field(default=EndReason.STOP)


class EmbeddingStream(OnBelt[Any]):
    """The vectors of one embedding request as the engine finishes them.

    Iterating (``for`` / ``async for``) yields ``Embedded`` chunks (``index``,
    ``vectors``) in input order; reading applies backpressure like a token stream.
    Leaving early, ``close()`` or ``cancel()`` stops the request (``user_cancel``)
    between ubatches. ``read()`` raises ``Cancelled`` when the request ended for any
    reason but ``stop`` (a deadline, a cancel): partial vectors are never a result.
    """

    def __init__(self, belt: Belt[Any], n_inputs: int) -> None:
        super().__init__(belt)
        self._n = n_inputs
        self._chunks: list[Embedded] = []

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=self._belt.trace.prompt_tokens, completion_tokens=0)

    def __iter__(self) -> Iterator[Embedded]:
        reader = iter(self._belt)
        try:
            for chunk in reader:
                self._chunks.append(chunk)
                yield chunk
        finally:
            reader.close()

    async def __aiter__(self) -> AsyncIterator[Embedded]:
        try:
            while True:
                try:
                    chunk = await self._belt.aget()
                except EndOfStream:
                    return
                self._chunks.append(chunk)
                yield chunk
        finally:
            if self._belt.end_reason is None:
                self._belt.close()

    def read(self) -> Embeddings:
        """Every vector (blocking); ``Cancelled`` if the request did not finish."""
        self._drain()
        return self.result()

    async def aread(self) -> Embeddings:
        """Async ``read()``; a cancelled task cancels the request too."""
        await self._adrain()
        return self.result()

    def result(self) -> Embeddings:
        """The vectors read, once the request ended ``stop``."""
        import numpy as np

        reason = self._belt.end_reason
        if reason is None:
            raise IllegalState("the request has not ended yet; read it first")
        if reason is not EndReason.STOP:
            raise Cancelled(reason)
        chunks = sorted(self._chunks, key=lambda c: c.index)
        array = np.concatenate([c.vectors for c in chunks]) if chunks else np.empty((0, 0))
        return Embeddings(array=array, usage=self.usage, trace=self.trace, end_reason=reason)


def ranking(stream: Embeddings, documents: Sequence[str], top_n: int | None) -> list[Ranked]:
    """The documents best first, from a rank model's scores (first of each row)."""
    scores = [float(row[0]) for row in stream.array]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_n is not None:
        order = order[:top_n]
    return [Ranked(i, scores[i], documents[i]) for i in order]


def _check_top_n(top_n: int | None) -> None:
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise InvalidArgument(f"top_n must be a positive integer, got {top_n!r}", param="top_n")


_T = TypeVar("_T")


class EmbeddingCalls(EngineCalls):
    """The embedding and rerank surface of ``Model``, over the two ways the model uses
    its loaded engine (``EngineCalls``), as a chat request is queued."""

    def embedding_info(self) -> EmbeddingInfo:
        """The model's ``EmbeddingInfo`` (dimension, pooling, input limit), loading it if
        it was unloaded for being idle; ``InvalidArgument`` for a model without."""
        return self._on_engine(lambda engine: self._embedder(engine).embedding_info())

    def _embedder(self, engine: Any) -> Embeds:
        if not isinstance(engine, Embeds):
            raise InvalidArgument(
                f"model {self.name} does not serve embeddings (its engine, {engine.name}, "
                "has none)",
                param="model",
            )
        return engine

    def _submit_embedding(
        self,
        make: Callable[[Embeds], EmbeddingRequest],
        kind: str,
        limits: Limits | None,
        request_id: str | None,
    ) -> EmbeddingStream:
        """Tokenize with ``make`` on the loaded engine, then queue as a chat request."""

        def prepare(engine: Any) -> tuple[EmbeddingRequest, int]:
            request = make(self._embedder(engine))
            return request, engine.count_prompt_tokens(request)

        def open_stream(request: EmbeddingRequest, belt: Belt[Any]) -> EmbeddingStream:
            belt.trace.kind = kind
            belt.trace.inputs = len(request.inputs)
            return EmbeddingStream(belt, len(request.inputs))

        return self._queue(prepare, open_stream, limits, None, request_id)

    def embeddings(
        self,
        texts: Sequence[TextOrTokens] | str,
        *,
        truncate: bool = False,
        normalize: bool = True,
        window: int | None = None,
        limits: Limits | None = None,
        request_id: str | None = None,
    ) -> EmbeddingStream:
        """Queue an embedding request and return its ``EmbeddingStream`` at once.

        ``texts`` is one string or a list (of strings, or of token-id lists). Each input
        may hold ``embedding_info().max_tokens`` tokens, or ``window`` where that is less
        (Ollama's ``num_ctx``): longer ones are cut with ``truncate``, else
        ``InvalidArgument`` names the input. The request takes a
        slot and a place in the admission queue like a chat request (``QueueFull``),
        its deadlines count from now (``first_token``: the first vectors), and a stop
        ends it between ubatches. ``normalize``: unit-length vectors.
        """
        items = [texts] if isinstance(texts, str) else texts

        def make(engine: Embeds) -> EmbeddingRequest:
            return prepare_inputs(
                engine, items, truncate=truncate, normalize=normalize, window=window
            )

        return self._submit_embedding(make, "embed", limits, request_id)

    def embed(self, texts: Sequence[TextOrTokens] | str, **options: Any) -> Embeddings:
        """Blocking ``embeddings(...).read()``: every vector, with usage and trace.

        Raises ``Cancelled`` when the request ended before its last vector (a stop, a
        deadline); a ``KeyboardInterrupt`` while waiting cancels it."""
        return self.embeddings(texts, **options).read()

    async def aembed(self, texts: Sequence[TextOrTokens] | str, **options: Any) -> Embeddings:
        """Async ``embed``: the queueing runs off the event loop, a cancelled task stops
        the request."""
        import asyncio

        stream = await asyncio.to_thread(self.embeddings, texts, **options)
        return await stream.aread()

    def reranking(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = False,
        limits: Limits | None = None,
        request_id: str | None = None,
    ) -> EmbeddingStream:
        """Queue a rerank of ``documents`` against ``query`` (one pair per document) and
        return its stream of score rows. ``InvalidArgument`` for a model whose pooling
        is not ``rank``: an embedding or chat model gives no relevance scores."""

        def make(engine: Embeds) -> EmbeddingRequest:
            return prepare_pairs(engine, query, documents, truncate=truncate)

        return self._submit_embedding(make, "rerank", limits, request_id)

    def rerank(
        self, query: str, documents: Sequence[str], *, top_n: int | None = None, **options: Any
    ) -> Ranking:
        """Blocking rerank: the documents best first (``top_n`` of them), with usage and
        trace; ``Cancelled`` when it ended early."""
        _check_top_n(top_n)
        stream = self.reranking(query, documents, **options)
        done = stream.read()
        return Ranking(
            tuple(ranking(done, documents, top_n)), done.usage, done.trace, done.end_reason
        )

    async def arerank(
        self, query: str, documents: Sequence[str], *, top_n: int | None = None, **options: Any
    ) -> Ranking:
        """Async ``rerank``; a cancelled task stops the request."""
        import asyncio

        _check_top_n(top_n)
        stream = await asyncio.to_thread(self.reranking, query, documents, **options)
        done = await stream.aread()
        return Ranking(
            tuple(ranking(done, documents, top_n)), done.usage, done.trace, done.end_reason
        )
