"""What the Responses routes remember: the responses in flight, and a bounded store.

In flight: every response being made (streamed, blocking or ``background``) is known by
its id until it ends, so ``POST /v1/responses/{id}/cancel`` can stop any of them.

The store is off unless the server is given a budget (``--responses-store``). Then a
response with ``store`` true is kept, within that many bytes (its JSON, its input
items and, for a background response, its events) and for a TTL after it was last
used; the least recently used go first. A conversation is a chain of links
(``previous_response_id``), each entry holding only its own items, so a long chain
costs what its turns cost, not the square of it. An id that is gone says why, as far
as the store knows (expired, evicted for space, deleted; the last ``TOMBSTONES``
such ids are remembered).

A background response has no reader by design. It is bounded by its deadlines and by
this budget: its events count against the store, finished entries are evicted to make
room for them, and when only running responses are left the background reader waits
for room, which leaves the model paused (its belt full) until something frees space,
a deadline ends it, or it is cancelled or deleted.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..._errors import InvalidArgument
from ...runtime import Stream
from ._turn import Turn

#: how many gone ids the store remembers the fate of
TOMBSTONES = 10_000


def size_of(value: object) -> int:
    """Bytes of ``value`` as compact JSON (what the store counts)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


class Gone(InvalidArgument):
    """A response id that is not here: never stored, expired, evicted or deleted; with
    ``asked``, the id a request named, whose conversation holds the one that is gone."""

    def __init__(self, response_id: str, why: str, *, asked: str | None = None) -> None:
        if asked is None:
            text = f"no response {response_id!r}: {why}"
        else:
            text = (
                f"response {asked!r} cannot be continued: an earlier response of its "
                f"conversation, {response_id!r}, is gone ({why})"
            )
        super().__init__(text, param="response_id")
        self.response_id = response_id
        self.why = why
        self.asked = asked


@dataclass
class Entry:
    """One stored response: the object, its own input items, its link to the one before."""

    response: dict[str, Any]
    items: list[dict[str, Any]]
    previous: str | None
    #: the request that made it (whose caller may read it)
    request_id: str = ""
    #: a background response's events, in order (None for any other)
    events: list[dict[str, Any]] | None = None
    size: int = 0
    used: float = 0.0
    #: still being made (never evicted; a background response's reader adds to it)
    running: bool = False
    grew: asyncio.Event = field(default_factory=asyncio.Event)

    def measure(self) -> int:
        """Its bytes: the response, its items and its events, as compact JSON."""
        events = size_of(self.events) if self.events is not None else 0
        return size_of(self.response) + size_of(self.items) + events

    def conversation_items(self) -> list[dict[str, Any]]:
        """Its input items, then its output items, as input items of a next turn."""
        output = [_as_input(item) for item in self.response.get("output", ())]
        return [*self.items, *output]


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type") == "message":
        parts = [
            {"type": "output_text", "text": p.get("text", "")}
            for p in item.get("content", ())
            if p.get("type") == "output_text"
        ]
        return {"type": "message", "role": "assistant", "content": parts, "id": item["id"]}
    keep = ("type", "id", "call_id", "name", "arguments")
    return {k: item[k] for k in keep if k in item}


class Store:
    """Stored responses within ``budget`` bytes and ``ttl`` seconds (off when budget 0)."""

    def __init__(
        self, budget: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if budget < 0 or not ttl > 0:
            raise InvalidArgument("the responses store needs a budget >= 0 and a ttl > 0")
        self.budget = budget
        self.ttl = ttl
        self._clock = clock
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.bytes = 0
        self.evictions: collections.Counter[str] = collections.Counter()
        self._room = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- bookkeeping -----------------------------------------------------------------------

    def _forget(self, response_id: str, why: str) -> None:
        entry = self._entries.pop(response_id)
        self.bytes -= entry.size
        self._gone[response_id] = why
        while len(self._gone) > TOMBSTONES:
            self._gone.popitem(last=False)
        if why != "deleted":
            self.evictions[why] += 1
        entry.grew.set()  # a reader resuming its events learns it is gone
        self._room.set()

    def _expire(self) -> None:
        now = self._clock()
        for rid, entry in list(self._entries.items()):
            if not entry.running and now - entry.used > self.ttl:
                self._forget(rid, "expired")

    def _make_room(self) -> None:
        for rid, entry in list(self._entries.items()):
            if self.bytes <= self.budget:
                return
            if not entry.running:
                self._forget(rid, "evicted")

    def _resize(self, entry: Entry, size: int) -> None:
        self.bytes += size - entry.size
        entry.size = size
        self._make_room()

    # -- the API ---------------------------------------------------------------------------

    def put(self, response_id: str, entry: Entry) -> None:
        """Keep ``entry`` (a finished response, or a running background one)."""
        self._expire()
        entry.used = self._clock()
        self._entries[response_id] = entry
        self._gone.pop(response_id, None)
        self._resize(entry, entry.measure())

    def get(self, response_id: str) -> Entry:
        """The entry (now the most recently used), or ``Gone`` saying why not."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            why = self._gone.get(response_id)
            raise Gone(response_id, _WHY.get(why or "", UNKNOWN))
        entry.used = self._clock()
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._forget(response_id, "deleted")

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The items of the whole chain that ends with ``response_id``, oldest first."""
        chain: list[Entry] = []
        seen: set[str] = set()
        rid: str | None = response_id
        while rid is not None and rid not in seen:
            seen.add(rid)
            try:
                entry = self.get(rid)
            except Gone as exc:
                if rid == response_id:
                    raise
                raise Gone(rid, exc.why, asked=response_id) from exc
            if entry.running:
                raise InvalidArgument(
                    f"response {rid!r} is still in progress", param="previous_response_id"
                )
            chain.append(entry)
            rid = entry.previous
        return [item for entry in reversed(chain) for item in entry.conversation_items()]

    def finish(self, response_id: str, response: dict[str, Any]) -> None:
        """A running entry's response ended: keep its final object."""
        entry = self._entries.get(response_id)
        if entry is None:
            return
        entry.response = response
        entry.running = False
        self._resize(entry, entry.measure())
        entry.grew.set()

    async def append(self, response_id: str, event: dict[str, Any]) -> None:
        """Add a background response's event, waiting while the budget has no room."""
        entry = self._entries.get(response_id)
        if entry is None or entry.events is None:
            return
        size = size_of(event)
        while self.bytes + size > self.budget and response_id in self._entries:
            self._make_room()
            if self.bytes + size <= self.budget:
                break
            self._room.clear()
            await self._room.wait()
        if response_id not in self._entries:
            return
        entry.events.append(event)
        self._resize(entry, entry.size + size)
        entry.grew.set()
        entry.grew = asyncio.Event()

    def info(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "budget_bytes": self.budget,
            "ttl_s": self.ttl,
            "entries": len(self._entries),
            "bytes": self.bytes,
            "evictions": dict(self.evictions),
        }


#: why an id is not here when the store knows nothing of it
UNKNOWN = "this server never stored it (or forgot it long ago)"
_WHY = {
    "expired": "it expired (the store keeps a response for its TTL after its last use)",
    "evicted": "it was evicted to make room (the store's byte budget was full)",
    "deleted": "it was deleted",
}


class Running:
    """A response being made: its turn and its request's stream."""

    def __init__(self, turn: Turn, stream: Stream, task: asyncio.Task[None] | None = None):
        self.turn = turn
        self.stream = stream
        #: a background response's reader
        self.task = task


class Responses:
    """The Responses dialect's memory for one app: responses in flight and the store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.running: dict[str, Running] = {}

    def collector(self) -> Collector:
        return _StoreCollector(self)


class _StoreCollector(Collector):
    def __init__(self, responses: Responses) -> None:
        self.responses = responses

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        store = self.responses.store
        yield GaugeMetricFamily(
            "tokenbelt_responses_stored", "Responses kept in the store", value=len(store)
        )
        yield GaugeMetricFamily(
            "tokenbelt_responses_store_bytes", "Bytes the stored responses take", value=store.bytes
        )
        yield GaugeMetricFamily(
            "tokenbelt_responses_store_budget_bytes",
            "The store's byte budget (0: no store)",
            value=store.budget,
        )
        evicted = CounterMetricFamily(
            "tokenbelt_responses_evicted",
            "Stored responses dropped by the store, by why (expired, evicted)",
            labels=["reason"],
        )
        for why in ("expired", "evicted"):
            evicted.add_metric([why], store.evictions[why])
        yield evicted
        yield GaugeMetricFamily(
            "tokenbelt_responses_in_flight",
            "Responses being made (streamed, blocking or background)",
            value=len(self.responses.running),
        )
