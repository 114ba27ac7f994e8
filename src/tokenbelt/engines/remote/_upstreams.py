"""Upstreams of a remote engine: least-outstanding-requests routing, ejection, health.

Every method runs on the remote engine's event loop (one thread), so the pool needs
no lock of its own; ``statistics()`` reads counters that the loop only ever
replaces, and may be called from any thread.

- ``acquire(exclude)`` picks, among upstreams that are not ejected and have room under
  their concurrency limit, the one with the fewest requests in flight (ties go to the
  one picked longest ago). With every healthy upstream at its limit it waits for a
  release; with none healthy it raises ``UpstreamUnavailable`` at once.
- ``eject(upstream, why)`` takes an upstream out (it refused, failed or reset) for a
  backoff that doubles on each consecutive ejection (``backoff`` to ``max_backoff``);
  after the backoff, or as soon as an active health check finds it answering again,
  it is back in.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..._errors import InvalidArgument, UpstreamUnavailable
from ...belt import check
from .._statistics import UpstreamStatistics
from ._kinds import Kind, Probed

logger = logging.getLogger("tokenbelt.engines.remote")


@dataclass(frozen=True)
class Upstream:
    """One OpenAI-compatible server: where it is, which model, how to authenticate.

    ``url`` is the base URL (``http://host:port``, with or without ``/v1``);
    ``model`` the upstream's own model name; ``api_key`` a Bearer key (the catalog
    reads it from an environment variable); ``headers`` extra headers for every
    request; ``max_concurrency`` how many requests it may hold at once; ``tokenbelt``
    says it is known to be a tokenbelt server (else the engine finds out from its
    answers, and probes what any other is, ``_kinds.py``): only a tokenbelt or vLLM
    upstream is sent the front's ``x-request-id`` (other servers have rules of their own
    for that header), and only a tokenbelt one is called to cancel.
    """

    url: str
    model: str
    api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    max_concurrency: int = 4
    tokenbelt: bool = False

    def __post_init__(self) -> None:
        url = self.url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
            raise InvalidArgument(f"an upstream URL starts with http:// or https://, got {url!r}")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        object.__setattr__(self, "url", url)
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument("an upstream needs the name of its model")
        check("upstream_concurrency", self.max_concurrency, label="max_concurrency")
        object.__setattr__(self, "headers", dict(self.headers))


class UpstreamState:
    """One upstream's live counters (owned by the pool's event loop)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.in_flight = 0
        self.requests = 0
        self.errors = 0
        self.ejections = 0
        self.ejected_until = 0.0
        self.backoff = 0.0
        self.last_error: str | None = None
        self.last_pick = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        #: what the upstream is (``_kinds.probe``); a tokenbelt one is known at once
        self.probed = Probed(Kind.TOKENBELT, done=True) if upstream.tokenbelt else Probed()

    @property
    def tokenbelt(self) -> bool:
        return self.probed.kind is Kind.TOKENBELT

    def seen_tokenbelt(self) -> None:
        """Its answers carry tokenbelt's extension: it is one, whatever the probe said."""
        if not self.tokenbelt:
            self.probed = Probed(Kind.TOKENBELT, done=True)

    @property
    def ejected(self) -> bool:
        return self.ejected_until > time.monotonic()

    def statistics(self) -> UpstreamStatistics:
        u = self.upstream
        return UpstreamStatistics(
            url=u.url,
            model=u.model,
            in_flight=self.in_flight,
            max_concurrency=u.max_concurrency,
            requests=self.requests,
            errors=self.errors,
            ejections=self.ejections,
            ejected=self.ejected,
            last_error=self.last_error,
            ttft_sum=self.ttft_sum,
            ttft_count=self.ttft_count,
            tokenbelt=self.tokenbelt,
        )


class UpstreamPool:
    """The upstreams of one model and the routing between them (see the module doc)."""

    def __init__(
        self,
        upstreams: Sequence[Upstream],
        *,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
    ) -> None:
        if not upstreams:
            raise InvalidArgument("a remote model needs at least one upstream")
        if not (math.isfinite(backoff) and 0 < backoff <= max_backoff):
            raise InvalidArgument(f"backoff must be > 0 and <= max_backoff, got {backoff}")
        self.states = [UpstreamState(u) for u in upstreams]
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._changed: asyncio.Event | None = None

    @property
    def slots(self) -> int:
        """Requests the pool can hold at once: the sum of the concurrency limits."""
        return sum(s.upstream.max_concurrency for s in self.states)

    def _wake(self) -> None:
        """Wake every ``acquire`` waiting for room (a release, or an upstream back in)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _unavailable(self, exclude: Sequence[UpstreamState]) -> str:
        parts = []
        for s in self.states:
            if s in exclude:
                parts.append(f"{s.upstream.url} failed this request ({s.last_error})")
            elif s.ejected:
                left = s.ejected_until - time.monotonic()
                parts.append(f"{s.upstream.url} ejected for {left:.1f} s ({s.last_error})")
        return "no upstream available: " + "; ".join(parts)

    async def acquire(self, exclude: Sequence[UpstreamState] = ()) -> UpstreamState:
        """The least-loaded usable upstream, its ``in_flight`` counted; waits for room.

        Raises ``UpstreamUnavailable`` when every upstream is ejected or in ``exclude``.
        Cancellation while waiting leaves nothing counted.
        """
        while True:
            usable = [s for s in self.states if s not in exclude and not s.ejected]
            if not usable:
                raise UpstreamUnavailable(self._unavailable(exclude))
            free = [s for s in usable if s.in_flight < s.upstream.max_concurrency]
            if free:
                best = min(free, key=lambda s: (s.in_flight, s.last_pick))
                best.in_flight += 1
                best.requests += 1
                best.last_pick = time.monotonic()
                return best
            if self._changed is None:
                self._changed = asyncio.Event()
            # Woken by a release or a readmission; an ejection that simply runs out is
            # seen at the next wake-up or health check.
            await self._changed.wait()

    def release(self, state: UpstreamState) -> None:
        """A request let go of ``state``: hand its room on (synchronous: safe in a
        ``finally`` of a cancelled task)."""
        state.in_flight -= 1
        self._wake()

    def succeeded(self, state: UpstreamState, ttft: float | None) -> None:
        """The upstream answered: it is healthy, its backoff starts over."""
        state.backoff = 0.0
        if ttft is not None:
            state.ttft_sum += ttft
            state.ttft_count += 1

    def failed(self, state: UpstreamState, why: str) -> None:
        """The upstream failed a request (counted, not ejected: a 4xx, say)."""
        state.errors += 1
        state.last_error = why

    def eject(self, state: UpstreamState, why: str) -> None:
        """Take ``state`` out for its backoff (doubling on each consecutive ejection)."""
        state.last_error = why
        if state.ejected:
            return
        state.backoff = min(self.max_backoff, state.backoff * 2 if state.backoff else self.backoff)
        state.ejected_until = time.monotonic() + state.backoff
        state.ejections += 1
        logger.warning("upstream %s ejected for %.1f s: %s", state.upstream.url, state.backoff, why)

    def readmit(self, state: UpstreamState) -> None:
        """A health check found ``state`` answering: back in at once."""
        if state.ejected:
            logger.info("upstream %s is back", state.upstream.url)
        state.ejected_until = 0.0
        self._wake()

    def statistics(self) -> list[UpstreamStatistics]:
        return [s.statistics() for s in self.states]
