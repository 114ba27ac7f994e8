"""The two ends of a belt, as the belt hands them out.

- ``BeltReader``: one pass of a consumer (``iter(belt)``, ``aiter(belt)``); leaving it
  early cancels the belt;
- ``Producer``: ``belt.producer``, the end an engine is given: room, puts, the stop, the
  request's life and the trace's counters, and nothing of the reader's side.

Both only forward to the ``Belt`` they wrap (``_belt.py``), which holds the state and
the lock; they carry no state of their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from .._errors import Cancelled, EndOfStream
from ._reasons import EndReason

if TYPE_CHECKING:
    from ._belt import Belt, BeltStatistics
    from ._trace import Trace

T = TypeVar("T")


class BeltReader(Generic[T]):
    """One pass of a consumer over a belt, sync or async.

    Leaving the loop early (``break``, an exception, ``close()``/``aclose()``, or
    the reader being garbage collected) cancels the belt with ``user_cancel``; after
    a natural end that cancel is a no-op and the end reason stays.
    """

    __slots__ = ("_belt",)

    def __init__(self, belt: Belt[T]) -> None:
        self._belt = belt

    def __iter__(self) -> BeltReader[T]:
        return self

    def __next__(self) -> T:
        try:
            return self._belt.get()
        except EndOfStream:
            raise StopIteration from None

    def __aiter__(self) -> BeltReader[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self._belt.aget()
        except EndOfStream:
            raise StopAsyncIteration from None

    def close(self) -> None:
        self._belt.close()

    async def aclose(self) -> None:
        self._belt.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._belt.close()


class Producer(Generic[T]):
    """The producer's end of a belt: all an engine may do with a request.

    One engine loop may hold many of these (a batch engine serves one per sequence):

    - ``has_room()`` / ``put_nowait()`` / ``on_room()``: the non-blocking protocol, so
      one loop never blocks on any single reader (``room()``: how many puts fit now);
    - ``wait_for_room()`` / ``put()`` / ``checkpoint()``: the blocking protocol of a
      thread that serves one request;
    - ``on_cancel()``, ``cancelled``, ``end_reason``: the stop, as it happens;
    - ``start()``, ``finish()``, ``fail()``, ``release()``: the request's life;
    - ``count_prompt()``, ``count_token()``, ``count_cached()``, ``count_draft()``,
      ``note_reasoning()``: the trace's counters.
    """

    __slots__ = ("_belt",)

    def __init__(self, belt: Belt[T]) -> None:
        self._belt = belt

    @property
    def trace(self) -> Trace:
        return self._belt.trace

    @property
    def capacity(self) -> int:
        return self._belt.capacity

    @property
    def cancelled(self) -> bool:
        return self._belt.cancelled

    @property
    def end_reason(self) -> EndReason | None:
        return self._belt.end_reason

    def statistics(self) -> BeltStatistics:
        """The belt's counters: how many items the reader has taken (``consumed``)."""
        return self._belt.statistics()

    def has_room(self) -> bool:
        return self._belt.has_room()

    def room(self) -> int:
        return self._belt.room()

    def put_nowait(self, item: T) -> None:
        self._belt.put_nowait(item)

    def on_room(self, callback: Callable[[], None]) -> bool:
        return self._belt.on_room(callback)

    def wait_for_room(self) -> None:
        self._belt.wait_for_room()

    def put(self, item: T) -> None:
        self._belt.put(item)

    def checkpoint(self) -> None:
        self._belt.checkpoint()

    def on_cancel(self, callback: Callable[[EndReason], None]) -> None:
        self._belt.on_cancel(callback)

    def start(self) -> None:
        self._belt.start()

    def finish(self, reason: EndReason = EndReason.STOP) -> bool:
        return self._belt.finish(reason)

    def fail(self, error: BaseException) -> bool:
        return self._belt.fail(error)

    def cancel(self, reason: EndReason) -> bool:
        """End the request for a reason of the engine's own (``shutdown`` on close)."""
        return self._belt.cancel(reason)

    def release(self) -> None:
        self._belt.release()

    def count_prompt(self, tokens: int) -> None:
        self._belt.trace.prompt_tokens = tokens

    def count_cached(self, tokens: int) -> None:
        self._belt.trace.cached_tokens = tokens

    def count_read(self, tokens: int) -> None:
        """``tokens`` of the prompt are in the KV cache so far (the prefill's progress)."""
        self._belt.trace.prompt_read = tokens

    def count_draft(self, drafted: int, accepted: int, decision: str) -> None:
        """The request's drafting totals: tokens drafted and verified, tokens accepted,
        and why drafting was on or off for it."""
        trace = self._belt.trace
        trace.draft_tokens, trace.accepted_draft_tokens = drafted, accepted
        trace.draft_decision = decision

    def note_reasoning(self, tokens: int, ended_by: str | None = None) -> None:
        """A thinking model's reasoning phase: started (first call), its token count, and
        what ended it (``Trace.mark_reasoning``)."""
        self._belt.trace.mark_reasoning(tokens, ended_by)

    def note_answer(self) -> None:
        """The first answer token after the reasoning was sampled (``Trace.mark_answer``)."""
        self._belt.trace.mark_answer()

    def count_token(self) -> None:
        self._belt.trace.completion_tokens += 1


class _Life(Protocol):
    """The calls that make a request's life: a ``Belt`` or its ``Producer``."""

    def start(self) -> object: ...
    def cancel(self, reason: EndReason) -> object: ...
    def fail(self, error: BaseException) -> object: ...
    def release(self) -> object: ...


@contextlib.contextmanager
def producing(end: _Life, on_exit: Callable[[], None] | None = None) -> Iterator[None]:
    """The producer protocol around a target that runs in the ``with`` block.

    Starts the request; a ``Cancelled`` raised inside ends quietly (the belt has the
    reason), any other exception ends with ``runtime_error``, a ``BaseException``
    (a cancelled task, ``KeyboardInterrupt``) with ``shutdown`` and goes on up; then
    ``on_exit`` runs (free the slot) and the release is recorded, even if it fails.
    """
    end.start()
    try:
        yield
    except Cancelled as exc:
        end.cancel(exc.reason)
    except Exception as exc:
        end.fail(exc)
    except BaseException:
        end.cancel(EndReason.SHUTDOWN)
        raise
    finally:
        try:
            if on_exit is not None:
                on_exit()
        finally:
            end.release()
