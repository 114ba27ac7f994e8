"""Progress while a long prompt is read: llama.cpp's ``return_progress`` for streams.

An agent's first request can take minutes to read on a small machine; a client (or an
agent's own timeout) that sees nothing cannot tell a busy server from a hung one.
A stream that asks for it gets, until its first token, an event whenever more of the
prompt is in the KV cache, in llama.cpp's shape: ``prompt_progress`` with ``total``,
``cache`` (tokens that came from the prefix cache), ``processed`` (cached ones
included: the overall progress is ``processed / total``) and ``time_ms`` since the
request was admitted. The trace holds the same count (``prompt_read``) for
``/v1/requests``, ``/metrics``, ``tokenbelt ps`` and the web page.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from ...belt import Trace

#: how often a waiting stream looks at its trace
POLL_S = 0.1


def prompt_progress(trace: Trace) -> dict[str, Any]:
    """The trace's prefill progress in llama.cpp's ``prompt_progress`` shape."""
    admitted = trace.admitted
    elapsed = 0.0 if admitted is None else max(0.0, trace.clock() - admitted)
    return {
        "total": trace.prompt_tokens,
        "cache": trace.cached_tokens,
        "processed": trace.prompt_read,
        "time_ms": round(elapsed * 1000, 3),
    }


async def with_progress(
    trace: Trace,
    events: AsyncIterator[object],
    event: Callable[[dict[str, Any]], object],
) -> AsyncIterator[object]:
    """``events``, with ``event(prompt_progress)`` before the first of them each time
    the prompt read so far grew. The events are awaited all along, never restarted."""
    pending: asyncio.Future[object] = asyncio.ensure_future(anext(events))
    said = -1
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=POLL_S)
            if done:
                break
            if trace.prompt_tokens and trace.prompt_read != said and trace.first_token is None:
                said = trace.prompt_read
                yield event(prompt_progress(trace))
        try:
            first = pending.result()
        except StopAsyncIteration:
            return
        yield first
        async for item in events:
            yield item
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


__all__ = ["prompt_progress", "with_progress"]
