"""One request of the remote engine, from its upstream's answer to its end: the events
read onto the belt (a read waits for room, so a paused reader stops the reads and TCP
pushes back on the upstream), and what the front knows of the upstream's end
(``trace.upstream["release"]``; see ``_engine.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from functools import partial

from ..._errors import Cancelled, UpstreamError, UpstreamUnavailable
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
            raise UpstreamError(f"upstream {url} failed: {error_message(event)}")
        extension = event.get("tokenbelt")
        if isinstance(extension, dict):
            state.tokenbelt = True
            if isinstance(extension.get("end_reason"), str):
                upstream_reason = extension["end_reason"]
            if isinstance(extension.get("trace"), dict) and p.trace.upstream is not None:
                p.trace.upstream = {**p.trace.upstream, "trace": extension["trace"]}
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


def record_release(job: Job) -> None:
    """``trace.upstream["release"]``: what the front knows of the upstream's end (see the
    module's docstring); nothing when no upstream answered."""
    trace = job.producer.trace
    info, fetch = trace.upstream, job.fetch
    if info is None or fetch is None:
        return
    error = None if fetch.cancelled() else fetch.exception()
    if not fetch.cancelled() and not isinstance(error, Cancelled):  # not stopped here
        release = "finished" if error is None else "upstream_ended"
    elif info.get("trace", {}).get("timeline_ms", {}).get("released") is not None:
        release = "confirmed"
    else:
        release = "unconfirmed"
    trace.upstream = {**info, "release": release}
