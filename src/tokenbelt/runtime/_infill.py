"""Code completion: the fill-in-the-middle surface of ``Model`` (``InfillCalls``).

The prompt is made on the loaded engine from the model's own FIM tokens
(``FillsMiddle``), then queued as a raw prompt of token ids through the chat surface's
``submit``: the same admission queue, deadlines, cancel, trace and end reasons, and a
supersede key so that the next keystroke's completion ends this one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._errors import InvalidArgument
from ..belt import Limits
from ..engines import (
    Engine,
    FillsMiddle,
    GenerationRequest,
    Infill,
    InfillPrompt,
    SamplingParams,
    fim_missing,
    no_fim_reason,
    sampling_from,
)
from ._stream import Reply, Stream
from ._supersede import Claim
from ._surface import EngineCalls


def fim_tokens_of(engine: Engine) -> dict[str, int]:
    """The FIM tokens of an engine's vocabulary; empty for one that cannot fill (a remote
    or scripted engine: it has no vocabulary here)."""
    return dict(engine.fim_tokens) if isinstance(engine, FillsMiddle) else {}


class InfillCalls(EngineCalls):
    """``Model``'s completions between a prefix and a suffix: ``infill_prompt`` (the
    prompt's tokens), ``stream_middle`` (queued, a ``Stream``), ``complete_middle`` and
    ``acomplete_middle`` (the whole ``Reply``)."""

    #: ``ChatCalls.submit``, which queues the request this surface makes
    submit: Callable[..., Stream]

    @property
    def fim_tokens(self) -> dict[str, int] | None:
        raise NotImplementedError

    @property
    def fills_middle(self) -> bool | None:
        """Whether the model's vocabulary has the FIM tokens a completion between a
        prefix and a suffix needs; None until it was first loaded (then it is known)."""
        tokens = self.fim_tokens
        return None if tokens is None else not fim_missing(tokens)

    def infill_prompt(self, infill: Infill, max_tokens: int) -> InfillPrompt:
        """The prompt tokens of ``infill`` on the loaded model, leaving room for
        ``max_tokens``; nothing is queued. Blocks to tokenize (and to reload a model
        unloaded for being idle). Raises ``InvalidArgument`` naming the model and what
        it lacks when it cannot fill in the middle."""

        def make(engine: Engine) -> InfillPrompt:
            if not isinstance(engine, FillsMiddle):
                raise InvalidArgument(
                    f"{no_fim_reason(self.name, [])}: its engine ({type(engine).__name__}) "
                    "has no vocabulary in this process to make a FIM prompt with",
                    param="suffix",
                )
            return engine.infill_prompt(infill, max_tokens)

        return self._on_engine(make)

    def infill_request(
        self,
        infill: Infill,
        sampling: SamplingParams,
        *,
        reuse_prefix: bool = True,
        draft: str | None = None,
    ) -> tuple[GenerationRequest, InfillPrompt]:
        """The generation request of ``infill`` (its prompt as token ids) and the prompt;
        blocks and raises as ``infill_prompt``."""
        prompt = self.infill_prompt(infill, sampling.max_tokens)
        request = GenerationRequest(
            prompt_tokens=prompt.tokens,
            sampling=sampling,
            reuse_prefix=reuse_prefix,
            draft=draft,
            infill=True,
        )
        return request, prompt

    def stream_middle(
        self,
        prefix: str,
        suffix: str = "",
        *,
        extra: Sequence[tuple[str, str]] = (),
        middle: str = "",
        order: str = "psm",
        supersede: str | Claim | None = None,
        limits: Limits | None = None,
        capacity: int | None = None,
        draft: str | None = None,
        **sampling: Any,
    ) -> Stream:
        """Complete the code between ``prefix`` and ``suffix``; returns the ``Stream`` of
        the middle at once (``for`` or ``async for`` it; ``read()``/``aread()`` for all).

        ``extra``: other files of the repository as ``(file name, text)`` pairs, put
        before the prefix. ``middle``: text the completion continues from (the current
        line up to the cursor). ``order``: ``psm`` or ``spm``. ``supersede``: a key (an
        editor's buffer, say): the earlier completions with that key end
        ``superseded``, queued or running, before this one queues. ``sampling``: as
        ``Model.stream``'s (``max_tokens``, ``temperature``, ``stop``, ...).

        Blocks to make the prompt; raises ``InvalidArgument`` for a model without FIM
        tokens (naming what it lacks), and as ``submit`` does.
        """
        infill = Infill(prefix, suffix, tuple(extra), middle, order)
        request, _ = self.infill_request(infill, sampling_from(sampling), draft=draft)
        return self.submit(request, limits=limits, capacity=capacity, supersede=supersede)

    def complete_middle(self, prefix: str, suffix: str = "", **kwargs: Any) -> Reply:
        """Blocking ``stream_middle(...).read()``: the whole middle as a ``Reply``."""
        return self.stream_middle(prefix, suffix, **kwargs).read()

    async def acomplete_middle(self, prefix: str, suffix: str = "", **kwargs: Any) -> Reply:
        """Async ``complete_middle``; cancelling the task cancels the request. Making the
        prompt (tokenizing, cheap) runs on the caller's thread, as ``Model.stream`` does."""
        return await self.stream_middle(prefix, suffix, **kwargs).aread()
