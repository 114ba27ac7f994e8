"""The parent's own view of a worker's model: its vocabulary only (a few MB, no weights).

Prompts are tokenized in the parent, so admission checks (``PromptTooLong``, a bad
``logit_bias`` or grammar) never wait on the worker, and the tokens travel with the
request's ``Start``: the worker's engine uses them as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._embedding import EmbeddingInfo
from ..llama import (
    Prompts,
    embedding_info,
    input_tokens,
    load_vocab,
    pair_tokens,
    read_header,
)


class PromptTokens(Prompts):
    """A model file's vocabulary and chat template (``Prompts`` over the vocabulary
    alone), and the prompts tokenized with them until their request is sent. Raises
    ``ModelLoadError`` when the file cannot be read. Close it with ``close()``."""

    def __init__(
        self, model_path: str | Path, name: str, *, context_length: int, reasoning: bool = True
    ) -> None:
        import llama_cpp

        self._vocab_model: Any = load_vocab(model_path)
        super().__init__(
            llama_cpp,
            self._vocab_model,
            name=name,
            context_length=context_length,
            reasoning=reasoning,
            # a vocabulary alone has no hyperparameters: the file's header says it
            trained=read_header(Path(model_path)).context_length,
        )

    def embedding_info(self, pooling: str | None, context_length: int) -> EmbeddingInfo:
        """The model's embedding size and pooling, from its metadata (no weights)."""
        return embedding_info(self._vocab_model, pooling, context_length)

    def inputs(self, texts: list[str]) -> list[list[int]]:
        """Each text's tokens as the worker's engine embeds it."""
        return input_tokens(self._vocab_model, texts)

    def pairs(self, query: str, documents: list[str]) -> list[list[int]]:
        """Each (query, document) pair as one input of a rank model."""
        return pair_tokens(self._vocab_model, query, documents)

    def close(self) -> None:
        self._vocab_model.close()
