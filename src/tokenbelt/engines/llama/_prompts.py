"""A batch engine's prompts: what a request's tokens are, checked before it queues.

``check_fits`` is the rule every llama engine keeps (an empty prompt, or one that
leaves no room to generate, is refused); ``KeptPrompts`` holds prompts tokenized on a
caller's thread for their admission on the loop's; ``Prompts`` is a loaded model's text
side (template, tool format, reasoning markers) that makes them.
"""

from __future__ import annotations

import threading
from typing import Any

from ..._errors import InvalidArgument, PromptTooLong
from .._infill import Infill, InfillPrompt
from .._request import GenerationRequest
from ._fim import infill_prompt, read_fim_tokens
from ._native import chat_formatter, prompt_tokens, template_tools, tool_format
from ._plan import common_prefix
from ._reasoning import ReasoningFormat, detect_reasoning, template_options
from ._sampling import check_request

#: prompts tokenized by ``count_prompt_tokens`` and kept for their admission
_MAX_TOKENIZED = 256


def check_fits(n: int, context_length: int, trained: int | None = None) -> None:
    """Refuse a prompt of ``n`` tokens that is empty or leaves a sequence no room to
    generate; raises ``InvalidArgument`` or ``PromptTooLong``, which names the context,
    what the model was trained on and the setting that makes room."""
    if n == 0:
        # An empty batch would reach llama_decode: refused, never decoded.
        raise InvalidArgument("the prompt is empty: it has no tokens to start from")
    if n + 1 > context_length:
        raise PromptTooLong(
            f"the prompt has {n} tokens but each sequence holds {context_length} "
            f"(including at least one generated token): {more_room(n, context_length, trained)}"
        )


def more_room(n: int, context_length: int, trained: int | None) -> str:
    """What gives a prompt of ``n`` tokens room past a context of ``context_length``: the
    setting and, where the model says it, the length it was trained on (every "does not
    fit" message ends with it, the engine's and a chat fitted to a window alike)."""
    if not trained:
        return "load it with a larger context (tokenbelt serve --n-ctx, n_ctx=...)"
    if context_length < trained:
        return (
            f"the model was trained on {trained} tokens; load it with a larger context "
            "(tokenbelt serve --n-ctx, n_ctx=...) up to that"
            + (", or past it with --force-n-ctx" if n + 1 > trained else "")
        )
    return (
        f"this is the {trained} tokens the model was trained on; a larger --n-ctx "
        "(n_ctx=...) needs --force-n-ctx (force_n_ctx=True), and past the trained length "
        "replies degrade"
    )


class KeptPrompts:
    """Prompts tokenized before queueing, kept for their admission.

    Keyed by identity, holding the request so its id cannot be reused; bounded, since a
    counted request may never be started (a full queue refuses it). Thread-safe.
    """

    def __init__(self, limit: int = _MAX_TOKENIZED) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._kept: dict[int, tuple[GenerationRequest, list[int]]] = {}

    def keep(self, request: GenerationRequest, tokens: list[int]) -> None:
        with self._lock:
            self._kept[id(request)] = (request, tokens)
            while len(self._kept) > self._limit:
                del self._kept[next(iter(self._kept))]

    def take(self, request: GenerationRequest) -> list[int] | None:
        """The tokens kept for ``request`` (forgotten here), or None."""
        with self._lock:
            kept = self._kept.pop(id(request), None)
        return kept[1] if kept is not None and kept[0] is request else None

    def peek(self, request: GenerationRequest) -> list[int] | None:
        """The tokens kept for ``request`` (still kept), or None."""
        with self._lock:
            kept = self._kept.get(id(request))
        return kept[1] if kept is not None and kept[0] is request else None


class Prompts:
    """A model's text side: its chat template, tool format and reasoning markers, each
    request's prompt tokens, and the prompts tokenized before they queue (kept for their
    admission, so the loop does not template them again). ``model`` is the loaded
    model, or its vocabulary alone (a worker's parent: ``worker/_vocab.py``).

    Tokenizing runs on the caller's thread (``count``: checked before queueing); the
    loop ``take``\\ s a request's tokens at its admission.
    """

    def __init__(
        self,
        lib: Any,
        model: Any,
        *,
        name: str,
        context_length: int,
        reasoning: bool,
        trained: int | None = None,
    ) -> None:
        self._lib = lib
        self._model = model
        self._name = name
        self._context_length = context_length
        #: the context the model was trained on, named when a prompt does not fit
        self._trained = trained or int(lib.llama_model_n_ctx_train(model.model))
        self._vocab = model.vocab
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.formatter = chat_formatter(model)
        #: whether the GGUF's chat template renders tools (then requests carry ``tools``)
        self.template_tools = template_tools(self.formatter)
        self.tool_format = tool_format(self.formatter)
        #: a thinking model's reasoning markers (None: it has none, or ``reasoning=False``
        #: asked for its output as one text, markers and all)
        self.reasoning: ReasoningFormat | None = (
            detect_reasoning(model, self.formatter) if reasoning else None
        )
        #: marker tokens rendered as their text even where the vocabulary holds them as
        #: control tokens (which render as nothing), so the splitter always sees them
        self.markers: dict[int, str] = {}
        if self.reasoning is not None:
            for marker in (self.reasoning.start, self.reasoning.end):
                ids = model.tokenize(marker.encode("utf-8"), False, True)
                if len(ids) == 1:
                    self.markers[int(ids[0])] = marker
        self._kept = KeptPrompts()
        #: the FIM tokens the vocabulary has (``FIM_TOKENS`` names -> ids)
        self.fim_tokens = read_fim_tokens(lib, self._vocab)

    def infill(self, infill: Infill, max_tokens: int) -> InfillPrompt:
        """The fill-in-the-middle prompt of ``infill`` (``_fim.py``); raises
        ``InvalidArgument`` when the vocabulary lacks a needed FIM token."""
        return infill_prompt(
            self._lib,
            self._model,
            self.fim_tokens,
            infill,
            name=self._name,
            context_length=self._context_length,
            max_tokens=max_tokens,
        )

    def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens for a request (chat template from the GGUF metadata)."""
        options = template_options(self.reasoning, request.sampling.think)
        return prompt_tokens(self._model, self.formatter, request, self._name, options)

    def count(self, request: GenerationRequest) -> int:
        """Check what only the model can check, tokenize (once) and keep the tokens for
        the admission; raises ``InvalidArgument`` or ``PromptTooLong``."""
        check_request(self._lib, self._vocab, self.n_vocab, request, self._name, self.reasoning)
        tokens = self._kept.peek(request)  # counted before (fitting a chat to a window)
        if tokens is None:
            tokens = self.tokenize(request)
        self.keep(request, tokens)
        return len(tokens)

    def remember(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Keep ``tokens``, just made by ``tokenize``, for ``request``."""
        self._kept.keep(request, tokens)

    def keep(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Use ``tokens`` (made here or by a worker's parent, with the same vocabulary) as
        ``request``'s prompt at its admission; ``PromptTooLong`` when they do not fit."""
        check_fits(len(tokens), self._context_length, self._trained)
        self._kept.keep(request, tokens)

    def kept(self, request: GenerationRequest) -> list[int] | None:
        """The tokens kept for ``request`` (forgotten here), or None."""
        return self._kept.take(request)

    def take(self, request: GenerationRequest) -> list[int]:
        """The prompt of ``request`` at its admission: the kept tokens, else made now."""
        kept = self.kept(request)
        return kept if kept is not None else self.tokenize(request)

    def template_head(self, limit: int) -> list[int]:
        """The tokens every chat prompt of this model starts with when it brings no
        system message (the template's own start, its default system prompt): the
        common prefix of two one-question prompts, at most ``limit``. Empty when the
        model has no chat template, or the head is shorter than 2 tokens."""
        if self.formatter is None:
            return []
        try:
            a, b = (
                self.tokenize(GenerationRequest.chat([{"role": "user", "content": q}]))
                for q in ("Why?", "How?")
            )
        except Exception:  # a template that cannot render a lone question: no head
            return []
        n = min(common_prefix(a, b), limit)
        return a[:n] if n >= 2 else []
