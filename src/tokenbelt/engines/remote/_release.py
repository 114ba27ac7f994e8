"""After a request's upstream stream ends: what the front knows of the upstream's end,
in ``trace.upstream`` (see ``_kinds.py`` for what each kind offers).

- ``release``: ``finished`` (the upstream's stream reached its own end), ``upstream_ended``
  (it failed or broke off), ``confirmed`` (stopped here, and the upstream showed that it
  let go) or ``unconfirmed`` (stopped here and the connection closed, and the upstream
  showed nothing more);
- with ``confirmed``: ``release_by`` (``trace``: a tokenbelt upstream's own trace of the
  request; ``metrics``: vLLM's ``vllm:num_requests_running`` + ``…_waiting`` fell to the
  requests this front still has there; ``slots``: llama.cpp's busy slots did) and
  ``released_at`` (wall clock, seconds: the upstream's own time from a trace, else when the
  front saw the count fall, an upper bound);
- with ``unconfirmed``: ``release_why``;
- ``abort``: what a vLLM's abort route answered, where it is served and was called.

The front waits at most ``RELEASE_WAIT_S`` for a confirmation, and records its own release
after it: a release confirmed late is a late release at the front, which raises the
release-lag alert like a local one.

A count is aggregate: it confirms exactly when this front is the upstream's only client and
none of its other requests there is starting or ending at the same moment; another client
ending a request then may be taken for this one's release.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..._errors import Cancelled
from ._kinds import UNCONFIRMABLE, Kind, metric
from ._relay import Job

if TYPE_CHECKING:
    import aiohttp

    from ._upstreams import UpstreamState

#: how long the front waits for an upstream to confirm a release
RELEASE_WAIT_S = 1.0

Headers = Mapping[str, str]


async def settle(session: aiohttp.ClientSession, job: Job, headers: Headers) -> None:
    """Record ``trace.upstream["release"]`` and what goes with it (on the engine's loop)."""
    trace, fetch, state = job.producer.trace, job.fetch, job.state
    if trace.upstream is None or fetch is None or state is None:
        return
    kind = state.probed.kind
    if kind is Kind.TOKENBELT:
        await _tokenbelt_trace(session, job, state, headers)
    error = None if fetch.cancelled() else fetch.exception()
    found: dict[str, Any]
    if not fetch.cancelled() and not isinstance(error, Cancelled):  # not stopped here
        found = {"release": "finished" if error is None else "upstream_ended"}
    elif kind is Kind.TOKENBELT:
        found = _from_trace(trace.upstream)
    elif kind is Kind.VLLM:
        found = await _count_falls(session, state, headers, _vllm_busy)
    elif kind is Kind.LLAMA_SERVER and state.probed.slots:
        found = await _count_falls(session, state, headers, _slots_busy)
    elif kind is Kind.LLAMA_SERVER:
        why = "llama.cpp's server was started with --no-slots: /slots does not answer"
        found = {"release": "unconfirmed", "release_why": why}
    else:
        found = {"release": "unconfirmed", "release_why": UNCONFIRMABLE[kind]}
    if job.aborting is not None:
        await asyncio.wait({job.aborting})  # bounded by its own timeout
        found["abort"] = job.abort
    # A new dict, never a change to the one others may be serialising.
    trace.upstream = {**trace.upstream, **found}


async def abort_at(session: aiohttp.ClientSession, job: Job, headers: Headers) -> None:
    """vLLM's ``/inference/v1/abort_requests`` for this request (it answers at once and
    aborts in the background: the confirmation is still the count)."""
    import aiohttp

    state = job.state
    if state is None:
        return
    prefix = "chatcmpl-" if job.request.messages is not None else "cmpl-"
    request_id = job.upstream_id or prefix + job.producer.trace.request_id
    try:
        async with session.post(
            f"{state.upstream.url}/inference/v1/abort_requests",
            json={"request_ids": [request_id]},
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=RELEASE_WAIT_S),
        ) as answer:
            job.abort = f"{answer.status} for {request_id}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        job.abort = f"failed: {type(exc).__name__}: {exc}"


def _from_trace(info: Mapping[str, Any]) -> dict[str, Any]:
    upstream = info.get("trace") or {}
    released = upstream.get("timeline_ms", {}).get("released")
    if released is None or not isinstance(upstream.get("enqueued_at"), int | float):
        why = f"the upstream's trace showed no release within {RELEASE_WAIT_S} s"
        return {"release": "unconfirmed", "release_why": why}
    at = upstream["enqueued_at"] + released / 1000
    return {"release": "confirmed", "release_by": "trace", "released_at": at}


async def _tokenbelt_trace(
    session: aiohttp.ClientSession, job: Job, state: UpstreamState, headers: Headers
) -> None:
    """From a tokenbelt upstream: its trace of this request, once it has released."""
    import aiohttp

    info = job.producer.trace.upstream or {}
    if info.get("trace", {}).get("timeline_ms", {}).get("released") is not None:
        return
    request_id = info.get("request_id") or job.producer.trace.request_id
    url = f"{state.upstream.url}/v1/requests/{request_id}"
    deadline = time.monotonic() + RELEASE_WAIT_S
    pause = 0.002
    while time.monotonic() < deadline:
        try:
            async with session.get(
                url, headers=headers, timeout=aiohttp.ClientTimeout(total=0.5)
            ) as answer:
                upstream = await answer.json() if answer.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        if isinstance(upstream, dict):
            info = {**info, "trace": upstream}
            job.producer.trace.upstream = info
            if upstream.get("timeline_ms", {}).get("released") is not None:
                return
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


Busy = Callable[["aiohttp.ClientSession", str, Headers], Awaitable["float | str"]]


async def _count_falls(
    session: aiohttp.ClientSession, state: UpstreamState, headers: Headers, busy: Busy
) -> dict[str, Any]:
    """Poll the upstream's count of requests at work until it is no more than the
    requests this front still has there (this one no longer counted in ``in_flight``)."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    pause = 0.002
    while True:
        count = await busy(session, state.upstream.url, headers)
        if isinstance(count, str):
            return {"release": "unconfirmed", "release_why": count}
        others = state.in_flight
        if count <= others:
            by = "slots" if busy is _slots_busy else "metrics"
            return {"release": "confirmed", "release_by": by, "released_at": time.time()}
        if time.monotonic() >= deadline:
            why = (
                f"{count:g} requests at work there after {RELEASE_WAIT_S} s, {others} of them ours"
            )
            return {"release": "unconfirmed", "release_why": why}
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.005)


async def _fetch_text(
    session: aiohttp.ClientSession, url: str, headers: Headers
) -> tuple[int, str]:
    import aiohttp

    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=0.5)
        ) as answer:
            return answer.status, await answer.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


async def _vllm_busy(session: aiohttp.ClientSession, url: str, headers: Headers) -> float | str:
    """vLLM's requests running and waiting, from ``/metrics`` (or why it cannot say)."""
    status, text = await _fetch_text(session, f"{url}/metrics", headers)
    if status != 200:
        return f"vLLM's /metrics did not answer ({status or text})"
    running = metric(text, "vllm:num_requests_running")
    waiting = metric(text, "vllm:num_requests_waiting")
    if running is None:
        return "vLLM's /metrics has no vllm:num_requests_running"
    return running + (waiting or 0.0)


async def _slots_busy(session: aiohttp.ClientSession, url: str, headers: Headers) -> float | str:
    """llama.cpp's server: how many of its slots are processing, from ``/slots``."""
    import json

    status, text = await _fetch_text(session, f"{url}/slots", headers)
    if status != 200:
        return f"llama.cpp's /slots did not answer ({status or text})"
    try:
        slots = json.loads(text)
    except ValueError:
        return "llama.cpp's /slots answered no JSON"
    if not isinstance(slots, list):
        return "llama.cpp's /slots answered no list"
    return float(sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing")))
