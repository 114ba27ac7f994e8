"""The parent's own view of a worker's model: its vocabulary only (a few MB, no weights).

Prompts are tokenized in the parent, so admission checks (``PromptTooLong``, a bad
``logit_bias`` or grammar) never wait on the worker, and the tokens travel with the
request's ``Start``: the worker's engine uses them as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._embedding import EmbeddingInfo
from .._request import GenerationRequest
from ..llama import (
    KeptPrompts,
    chat_formatter,
    check_request,
    detect_reasoning,
    embedding_info,
    input_tokens,
    load_vocab,
    pair_tokens,
    prompt_tokens,
    template_options,
    template_tools,
    tool_format,
)


class PromptTokens:
    """A model file's vocabulary and chat template, and the prompts tokenized with them
    until their request is sent. Raises ``ModelLoadError`` when the file cannot be read.
    Close it with ``close()``."""

    def __init__(self, model_path: str | Path, name: str, *, reasoning: bool = True) -> None:
        self.name = name
        self._vocab: Any = load_vocab(model_path)
        self._formatter = chat_formatter(self._vocab)
        self._kept = KeptPrompts()  # sent with each request: the worker uses them
        #: whether the GGUF's chat template renders tools (then requests carry ``tools``)
        self.template_tools = template_tools(self._formatter)
        #: the tool-call family of that template
        self.tool_format = tool_format(self._formatter)
        #: a thinking model's reasoning markers, as the worker's engine finds them
        self.reasoning = detect_reasoning(self._vocab, self._formatter) if reasoning else None

    def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens for a request, as the worker's engine makes them."""
        options = template_options(self.reasoning, request.sampling.think)
        return prompt_tokens(self._vocab, self._formatter, request, self.name, options)

    def check(self, request: GenerationRequest) -> None:
        """What only the model can check before a request queues: ``logit_bias`` names
        tokens of its vocabulary, a grammar parses against it (``InvalidArgument``)."""
        import llama_cpp

        vocab = self._vocab.vocab
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        check_request(llama_cpp, vocab, n_vocab, request, self.name, self.reasoning)

    def keep(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Keep ``tokens`` as the prompt of ``request``, for ``take``."""
        self._kept.keep(request, tokens)

    def take(self, request: GenerationRequest) -> list[int] | None:
        """The tokens ``count`` kept for ``request`` (forgotten here), or None."""
        return self._kept.take(request)

    def peek(self, request: GenerationRequest) -> list[int] | None:
        """The tokens kept for ``request`` (still kept), or None."""
        return self._kept.peek(request)

    def embedding_info(self, pooling: str | None, context_length: int) -> EmbeddingInfo:
        """The model's embedding size and pooling, from its metadata (no weights)."""
        return embedding_info(self._vocab, pooling, context_length)

    def inputs(self, texts: list[str]) -> list[list[int]]:
        """Each text's tokens as the worker's engine embeds it."""
        return input_tokens(self._vocab, texts)

    def pairs(self, query: str, documents: list[str]) -> list[list[int]]:
        """Each (query, document) pair as one input of a rank model."""
        return pair_tokens(self._vocab, query, documents)

    def close(self) -> None:
        self._vocab.close()
