"""The consumer's handle on one request: a sync and async iterator of text pieces."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

from .._errors import EndOfStream, IllegalState
from ..belt import Belt, BeltStatistics, EndReason, Trace
from ..engines import Piece, TokenLogprob
from ._calls import ToolCall
from ._structured import Structure

#: how long ``read()`` waits, after the last piece, for the engine to let go of the request
RELEASE_WAIT_S = 5.0


@dataclass(frozen=True)
class Usage:
    """Token counts of one request, as in the OpenAI API."""

    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens taken from the prefix cache instead of computed
    cached_tokens: int = 0
    #: completion tokens a thinking model spent in its reasoning phase (None: it had none)
    reasoning_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        } | (
            {}
            if self.reasoning_tokens is None
            else {"completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}
        )


@dataclass(frozen=True)
class Reply:
    """A finished request: its text, usage, trace and end reason.

    With a ``schema``, ``parsed`` is the reply parsed (a pydantic model's instance, or
    the JSON value), or None when the reply ended early; with ``tools``,
    ``tool_calls`` holds the call the reply made (``text`` keeps it as written).
    """

    text: str
    usage: Usage
    trace: Trace
    end_reason: EndReason
    #: each generated token's log-probability, when the request asked for ``logprobs``
    logprobs: tuple[TokenLogprob, ...] = ()
    #: the object a ``schema`` turn parsed, when it ended naturally
    parsed: Any = None
    #: the tool calls of a ``tools`` turn, when it ended naturally
    tool_calls: tuple[ToolCall, ...] = ()
    #: each generated token's id, when the request asked for ``return_token_ids``
    token_ids: tuple[int, ...] = ()
    #: a thinking model's reasoning text (``text`` is its answer)
    reasoning: str = ""

    @property
    def answer_started(self) -> bool:
        """False when a thinking model's reply ended inside its reasoning phase: a
        limit (``max_tokens``, a deadline) or a stop ended it before any answer."""
        return self.trace.phase != "reasoning"

    @property
    def finish_reason(self) -> str:
        """The OpenAI-style finish reason (see ``EndReason.openai_finish_reason``);
        ``tool_calls`` when the reply ended with a call."""
        if self.tool_calls and self.end_reason is EndReason.STOP:
            return "tool_calls"
        return self.end_reason.openai_finish_reason


_T = TypeVar("_T")


class OnBelt(Generic[_T]):
    """What every request handle of the SDK shares over its belt: its identity, trace and
    end reason, and the ways to stop it and wait for its release; a context manager
    (sync and async) that closes it, and closes it when dropped."""

    def __init__(self, belt: Belt[_T]) -> None:
        self._belt = belt

    @property
    def request_id(self) -> str:
        return self._belt.trace.request_id

    @property
    def trace(self) -> Trace:
        """The request's timeline, counters and end reason (live while it runs)."""
        return self._belt.trace

    @property
    def end_reason(self) -> EndReason | None:
        return self._belt.end_reason

    def cancel(self, reason: EndReason = EndReason.USER_CANCEL) -> bool:
        """Stop the request; returns True if this call ended it. Never blocks."""
        return self._belt.cancel(reason)

    def close(self) -> None:
        self._belt.close()

    async def aclose(self) -> None:
        self._belt.close()

    def wait_released(self, timeout: float | None = None) -> bool:
        """Block until the engine let go of the request (slot free)."""
        return self._belt.wait_released(timeout)

    async def await_released(self, timeout: float | None = None) -> bool:
        """Async ``wait_released()``: True once the trace holds the release time."""
        return await self._belt.await_released(timeout)

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError

    def __aiter__(self) -> AsyncIterator[Any]:
        raise NotImplementedError

    def _drain(self) -> None:
        """Read every item, then wait (at most ``RELEASE_WAIT_S``) for the release; any
        exception meanwhile (a ``KeyboardInterrupt``) cancels the request first."""
        try:
            for _ in self:
                pass
            self._belt.wait_released(RELEASE_WAIT_S)
        except BaseException:
            self.cancel()
            raise

    async def _adrain(self) -> None:
        """Async ``_drain()``: a cancelled task cancels the request too."""
        try:
            async for _ in self:
                pass
            await self._belt.await_released(RELEASE_WAIT_S)
        except BaseException:
            self.cancel()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._belt.close()


class Stream(OnBelt[str]):
    """Text pieces of one request as they are generated.

    Iterate it with ``for`` or ``async for`` (or both in turn). Reading applies
    backpressure: generation runs at most ``capacity`` pieces ahead of you.
    A thinking model's pieces say which part they belong to: a ``Piece`` whose
    ``reasoning`` holds text of the reasoning phase (its ``str`` is the answer's text,
    often empty then); ``text`` is the answer, ``reasoning`` the reasoning.
    Leaving the loop early (``break``), ``close()``/``aclose()`` or ``cancel()``
    stops the model with ``user_cancel``; ``cancel(reason)`` is idempotent and
    safe from any thread or task. The loop ends quietly for every end reason but
    ``runtime_error``, which raises the engine's own exception; look at
    ``end_reason`` to know why it ended.
    """

    def __init__(
        self,
        belt: Belt[str],
        *,
        on_complete: Callable[[Stream], None] | None = None,
        structure: Structure | None = None,
    ) -> None:
        super().__init__(belt)
        self._structure = structure
        self._pieces: list[str] = []
        self._reasoning: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._token_ids: list[int] = []
        self._on_complete = on_complete
        self._completed = False

    # -- what it is --------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """Everything read so far."""
        return "".join(self._pieces)

    @property
    def reasoning(self) -> str:
        """A thinking model's reasoning text read so far (empty for other models)."""
        return "".join(self._reasoning)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """The log-probability of each token read so far (``logprobs=True``; else empty).

        A token whose text is held back (the start of a stop string, part of a
        character) is here as soon as it is read, before its text is.
        """
        return self._logprobs

    @property
    def token_ids(self) -> list[int]:
        """The id of each token read so far (``return_token_ids=True``; else empty); like
        ``logprobs``, a token whose text is held back is here as soon as it is read."""
        return self._token_ids

    @property
    def usage(self) -> Usage:
        t = self._belt.trace
        return Usage(
            prompt_tokens=t.prompt_tokens,
            completion_tokens=t.completion_tokens,
            cached_tokens=t.cached_tokens,
            reasoning_tokens=None if t.reasoning_started is None else t.reasoning_tokens,
        )

    def statistics(self) -> BeltStatistics:
        """The belt's fill, peak, produced and consumed counts."""
        return self._belt.statistics()

    # -- reading -----------------------------------------------------------------------------

    def _got(self, piece: str) -> None:
        self._pieces.append(piece)

    def _scored(self, piece: str) -> bool:
        """Take what a ``Piece`` carries; True when it carries reasoning text."""
        if not isinstance(piece, Piece):
            return False
        self._logprobs.extend(piece.logprobs)
        self._token_ids.extend(piece.token_ids)
        if piece.reasoning:
            self._reasoning.append(piece.reasoning)
            return True
        return False

    def _ended(self) -> None:
        reason = self._belt.end_reason
        if not self._completed and reason is not None and reason.is_natural:
            self._completed = True
            if self._on_complete is not None:
                self._on_complete(self)

    def __iter__(self) -> Iterator[str]:
        reader = iter(self._belt)
        try:
            while True:
                try:
                    piece = next(reader)
                except StopIteration:
                    self._ended()
                    return
                thought = self._scored(piece)
                if piece:
                    self._got(piece)
                if piece or thought:
                    yield piece
        finally:
            reader.close()

    def __aiter__(self) -> AsyncIterator[str]:
        return _AsyncPieces(self)

    def read(self) -> Reply:
        """Read to the end (blocking) and return the ``Reply``.

        Then waits (at most ``RELEASE_WAIT_S``) for the engine to let go, so that the
        reply's trace holds ``released`` and ``end_to_end_ms``. A ``KeyboardInterrupt``
        (or any exception) while waiting cancels the request with ``user_cancel``
        before it propagates.
        """
        self._drain()
        return self.reply()

    async def aread(self) -> Reply:
        """Async ``read()``; a cancelled task cancels the request too."""
        await self._adrain()
        return self.reply()

    def reply(self) -> Reply:
        """What was read so far, as a ``Reply`` (``end_reason`` must be known)."""
        reason = self._belt.end_reason
        if reason is None:
            raise IllegalState("the stream has not ended yet; read it first")
        text = self.text
        parsed: Any = None
        calls: tuple[ToolCall, ...] = ()
        if self._structure is not None:
            natural = reason is EndReason.STOP and self.trace.stop_sequence is None
            parsed, calls = self._structure.parse(text, natural)
        return Reply(
            text=text,
            usage=self.usage,
            trace=self.trace,
            end_reason=reason,
            logprobs=tuple(self._logprobs),
            parsed=parsed,
            tool_calls=calls,
            token_ids=tuple(self._token_ids),
            reasoning=self.reasoning,
        )

    def __repr__(self) -> str:
        reason = self.end_reason.value if self.end_reason else None
        return f"<Stream {self.request_id} end_reason={reason!r}>"


class _AsyncPieces:
    """The async iterator of a ``Stream``; dropping it early cancels (``user_cancel``)."""

    __slots__ = ("_done", "_stream")

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._done = False

    def __aiter__(self) -> _AsyncPieces:
        return self

    async def __anext__(self) -> str:
        belt = self._stream._belt
        while True:
            try:
                piece = await belt.aget()
            except EndOfStream:
                self._done = True
                self._stream._ended()
                raise StopAsyncIteration from None
            thought = self._stream._scored(piece)
            if piece:
                self._stream._got(piece)
            if piece or thought:
                return piece

    async def aclose(self) -> None:
        self._stream.close()

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):
                self._stream._belt.close()
