"""Embedding and rerank work, as a request: what it asks, what goes on its belt.

An ``EmbeddingRequest`` is a request like a ``GenerationRequest``: the scheduler queues
it, gives it a slot, and the engine ``start``\\ s it with a producer. Its inputs are
token ids (tokenized before it queues, so lengths are checked and counted up front);
each item the engine puts on its belt is an ``Embedded``: the vectors of the inputs
that one engine step finished, in input order. The first item is the request's first
result (its first-token deadline), the last is followed by ``finish(stop)``.

An engine that can embed says so with ``embedding_info()`` and tokenizes inputs with
``tokenize_inputs`` / ``tokenize_pairs`` (the ``Embeds`` protocol).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

#: how the vectors of one input's tokens become one vector (llama.cpp's pooling types)
POOLINGS = ("mean", "cls", "last", "rank")


@dataclass(frozen=True, slots=True)
class EmbeddingInfo:
    """What a model's embeddings are: their size, pooling and input limit."""

    #: the length of one vector (``n_embd``), or of one score row for ``rank``
    dimension: int
    #: one of ``POOLINGS``
    pooling: str
    #: where the pooling came from: ``gguf`` (the file's ``pooling_type``),
    #: ``catalog`` (an override) or ``default`` (none given: ``mean``)
    pooling_source: str
    #: the most tokens one input (or one query-document pair) may have
    max_tokens: int
    #: token ids run from 0 to ``vocab_size - 1``
    vocab_size: int


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """Embed (``pooling`` other than rank) or score (rank) tokenized inputs.

    ``normalize``: L2-normalise each vector (the OpenAI and Ollama APIs' vectors are
    unit length); a rank model's scores are never normalised.
    """

    inputs: tuple[tuple[int, ...], ...]
    normalize: bool = True

    @property
    def n_tokens(self) -> int:
        return sum(len(i) for i in self.inputs)


@dataclass(frozen=True, slots=True)
class Embedded:
    """The vectors of inputs ``index`` to ``index + len(vectors) - 1`` (float32 rows of a
    numpy array); picklable, so it crosses the worker's pipe as it is."""

    index: int
    vectors: Any


@runtime_checkable
class Embeds(Protocol):
    """An engine that serves ``EmbeddingRequest``\\ s beside its generation."""

    def embedding_info(self) -> EmbeddingInfo:
        """The model's embedding size, pooling and input limit (cheap, any thread)."""
        ...

    def tokenize_inputs(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's tokens as the model embeds it (its special tokens added)."""
        ...

    def tokenize_pairs(self, query: str, documents: Sequence[str]) -> list[list[int]]:
        """Each (query, document) pair as one input of a rank model."""
        ...
