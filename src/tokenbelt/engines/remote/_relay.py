"""One request of the remote engine, from its upstream's answer to its end: the events
read onto the belt (a read waits for room, so a paused reader stops the reads and TCP
pushes back on the upstream), the upstream's own id of it, and its end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from functools import partial

from ..._errors import UpstreamError, UpstreamUnavailable
from ...belt import EndReason, Producer
from .._request import GenerationRequest
from ._session import wake_threadsafe
from ._upstreams import UpstreamPool, UpstreamState
from ._wire import error_message

_FINISH = {"stop": EndReason.STOP, "length": EndReason.LENGTH}


@dataclass(eq=False)
class Job:
    """One request on the engine: what it asks, its belt, and its upstream as it goes."""

    request: GenerationRequest
    producer: Producer[str]
    on_exit: Callable[[], None]
    state: UpstreamState | None = None
    upstream_id: str | None = None
    produced: int = 0
    fetch: asyncio.Task[EndReason] | None = None
    cancelling: asyncio.Task[None] | None = None
    #: the call to a vLLM's abort route, and what it answered (``_release.abort_at``)
    aborting: asyncio.Task[None] | None = None
    abort: str | None = None


async def relay(
    job: Job,
    pool: UpstreamPool,
    state: UpstreamState,
    events: AsyncGenerator[str, None],
    chat: bool,
    sent: float,
) -> EndReason:
    """Events to belt pieces; returns the natural end, raises on an upstream error."""
    p = job.producer
    url = state.upstream.url
    finish: str | None = None
    upstream_reason: str | None = None
    completion: int | None = None
    async for data in events:
        if data == "[DONE]":
            if state.tokenbelt:
                # Only a tokenbelt upstream's connection is kept for the next request:
                # llama-cpp-python's server took a stream on a reused connection for a
                # disconnect, and a new connection costs one round trip.
                await drain(events)
            break
        try:
            event = json.loads(data)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            raise UpstreamError(f"upstream {url} sent a malformed event: {data[:80]!r}")
        if event.get("error"):
            raise _event_error(event, url)
        extension = event.get("tokenbelt")
        if isinstance(extension, dict):
            state.seen_tokenbelt()
            if isinstance(extension.get("end_reason"), str):
                upstream_reason = extension["end_reason"]
            if isinstance(extension.get("trace"), dict) and p.trace.upstream is not None:
                p.trace.upstream = {**p.trace.upstream, "trace": extension["trace"]}
        if job.upstream_id is None and isinstance(event.get("id"), str):
            # The upstream's own id of the request (vLLM's embeds the front's id).
            job.upstream_id = event["id"]
            if p.trace.upstream is not None:
                p.trace.upstream = {**p.trace.upstream, "request_id": event["id"]}
        usage = event.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                p.count_prompt(usage["prompt_tokens"])
            if isinstance(usage.get("completion_tokens"), int):
                completion = usage["completion_tokens"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if isinstance(piece, str) and piece:
                await room(p)
                if not job.produced:
                    pool.succeeded(state, time.monotonic() - sent)
                job.produced += 1
                p.count_token()
                p.put_nowait(piece)
            if choice.get("finish_reason"):
                finish = str(choice["finish_reason"])
    if finish is None:
        raise UpstreamUnavailable(f"upstream {url} closed the stream before its end")
    if completion is not None:
        p.trace.completion_tokens = completion
    if not job.produced:
        pool.succeeded(state, None)
    reason = _FINISH.get(finish)
    if upstream_reason is not None and upstream_reason not in _FINISH:
        # A tokenbelt upstream's early end reads "stop"/"length" in OpenAI's terms;
        # its exact reason says it was not a natural one.
        reason = None
    if reason is None:
        raise UpstreamError(f"upstream {url} ended the request: {upstream_reason or finish}")
    return reason


def _event_error(event: dict[str, object], url: str) -> UpstreamError:
    """An error event: vLLM answers a bad streaming request with a 200 and one event that
    holds the status (``code``); a 4xx there passes through like an answered 4xx."""
    error = event.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and 400 <= code < 500:
        return UpstreamError(error_message(event), status=code)
    if isinstance(code, int) and code >= 500:
        return UpstreamUnavailable(f"upstream {url} failed: {error_message(event)}", status=code)
    return UpstreamError(f"upstream {url} failed: {error_message(event)}")


async def drain(events: AsyncGenerator[str, None]) -> None:
    """Read the end of a finished body, so that its connection serves the next request
    (one left unread is closed); an upstream that keeps it open gets a second."""
    import aiohttp

    with contextlib.suppress(TimeoutError, aiohttp.ClientError, UpstreamError):
        async with asyncio.timeout(1.0):
            async for _ in events:
                pass


async def room(producer: Producer[str]) -> None:
    """Wait for room on the belt (the read pauses meanwhile); raise once it ended."""
    loop = asyncio.get_running_loop()
    while not producer.has_room():
        producer.checkpoint()
        woken = asyncio.Event()
        if producer.on_room(partial(wake_threadsafe, loop, woken)):
            await woken.wait()
