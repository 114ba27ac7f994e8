"""What code completion costs a model and how fast it answers (``CompletionStatistics``).

An editor asks for a completion at each keystroke, and most of them go stale: the next
keystroke supersedes them, or the client goes away. What is worth seeing is how many
went stale, the work spent on them after their stop (``Trace.tokens_after_stop``: what
the next keystroke's completion waited behind), and the time from a keystroke's request
to its first token. ``CompletionTally`` counts them from one model's released traces;
``/metrics`` counts the same from the same traces, by API.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

from ..belt import EndReason, TraceEvent

#: the ends of a request whose reply nobody reads any more: what it computes after its
#: stop is stale work
STALE_ENDS = frozenset({EndReason.SUPERSEDED, EndReason.CLIENT_DISCONNECT})
#: the latest completions whose first tokens the percentiles are of
WINDOW = 512


def _rank(ordered: list[float], q: float) -> float | None:
    """The value at rank ``int(q * n)`` of sorted values (as the benchmarks take it)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


@dataclass(frozen=True)
class CompletionStatistics:
    """A model's code completions since it was made (``Model.status().completions``)."""

    #: completions (fill-in-the-middle requests) released
    completions: int
    #: requests that ended ``superseded`` (a newer one with their supersede key came)
    superseded: int
    #: tokens computed for requests after they were superseded or their client went away
    stale_tokens: int
    #: seconds from a completion's arrival (its enqueue) to its first token, median and
    #: 95th percentile of the latest ``WINDOW`` that had one (None: none had)
    first_token_p50: float | None
    first_token_p95: float | None

    def to_dict(self) -> dict[str, Any]:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 1)

        return {
            "completions": self.completions,
            "superseded": self.superseded,
            "stale_tokens": self.stale_tokens,
            "first_token_p50_ms": ms(self.first_token_p50),
            "first_token_p95_ms": ms(self.first_token_p95),
        }


class CompletionTally:
    """Counts a model's ``CompletionStatistics`` from its requests' traces: a trace
    observer, quick and thread-safe (it runs on whichever thread releases a request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._completions = self._superseded = self._stale = 0
        self._first: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def observe(self, event: TraceEvent) -> None:
        """Count a request once, at its release."""
        if event.kind != "released":
            return
        t = event.trace
        first = t.time_to_first_token if t.infill else None
        with self._lock:
            self._completions += t.infill
            self._superseded += t.end_reason is EndReason.SUPERSEDED
            if t.end_reason in STALE_ENDS:
                self._stale += t.tokens_after_stop
            if first is not None:
                self._first.append(first)

    def statistics(self) -> CompletionStatistics:
        with self._lock:
            first = sorted(self._first)
            counts = (self._completions, self._superseded, self._stale)
        return CompletionStatistics(
            *counts,
            first_token_p50=_rank(first, 0.5),
            first_token_p95=_rank(first, 0.95),
        )
