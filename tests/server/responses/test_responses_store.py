"""The response store on its own: a byte budget, a TTL, LRU eviction, and gone ids that
say why. A fake clock drives the TTL; nothing sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenbelt._errors import InvalidArgument
from tokenbelt.server.responses import Store
from tokenbelt.server.responses._store import Entry, Gone, size_of


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _response(rid: str, text: str = "x" * 100) -> dict[str, Any]:
    message = {
        "id": "msg_" + rid,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }
    return {"id": rid, "output": [message]}


def _entry(rid: str, previous: str | None = None, text: str = "x" * 100) -> Entry:
    items = [
        {
            "type": "message",
            "role": "user",
            "id": "in_" + rid,
            "content": [{"type": "input_text", "text": "q " + rid}],
        }
    ]
    return Entry(_response(rid, text), items, previous, "req_" + rid)


def _store(budget: int = 10_000, ttl: float = 60.0) -> tuple[Store, Clock]:
    clock = Clock()
    return Store(budget, ttl, clock), clock


def test_the_store_counts_bytes_and_evicts_the_least_recently_used() -> None:
    one = size_of(_entry("a").response) + size_of(_entry("a").items)
    store, _ = _store(budget=3 * one)
    for rid in ("a", "b", "c"):
        store.put(rid, _entry(rid))
    assert len(store) == 3
    assert store.bytes == 3 * one
    store.get("a")  # used: b is now the oldest
    store.put("d", _entry("d"))
    assert store.bytes <= store.budget
    with pytest.raises(Gone, match="evicted to make room"):
        store.get("b")
    assert store.get("a").response["id"] == "a"
    assert store.evictions["evicted"] == 1


def test_an_entry_expires_its_ttl_after_its_last_use() -> None:
    store, clock = _store(ttl=10)
    store.put("a", _entry("a"))
    store.put("b", _entry("b"))
    clock.now = 8
    store.get("a")
    clock.now = 12
    assert store.get("a").response["id"] == "a"
    with pytest.raises(Gone, match="expired"):
        store.get("b")
    assert store.evictions["expired"] == 1


def test_gone_ids_say_why() -> None:
    store, _ = _store()
    store.put("a", _entry("a"))
    store.delete("a")
    with pytest.raises(Gone, match="deleted"):
        store.get("a")
    with pytest.raises(Gone, match="never stored"):
        store.get("zzz")
    assert store.evictions == {}  # a delete is not an eviction


def test_a_conversation_is_its_chain_of_links() -> None:
    store, _ = _store()
    store.put("a", _entry("a"))
    store.put("b", _entry("b", previous="a"))
    store.put("c", _entry("c", previous="b"))
    items = store.conversation("c")
    assert [i["id"] for i in items] == ["in_a", "msg_a", "in_b", "msg_b", "in_c", "msg_c"]
    assert items[1] == {
        "type": "message",
        "role": "assistant",
        "id": "msg_a",
        "content": [{"type": "output_text", "text": "x" * 100}],
    }
    # Each entry holds its own turn only: the chain costs its turns, not their square.
    assert store.get("c").size == store.get("a").size
    store.delete("a")
    with pytest.raises(Gone, match="earlier response of its conversation, 'a', is gone") as gone:
        store.conversation("c")
    assert (gone.value.response_id, gone.value.asked) == ("a", "c")


def test_a_running_entry_is_never_evicted_and_its_events_wait_for_room() -> None:
    event = {"type": "response.output_text.delta", "delta": "y" * 200}
    base = size_of(_entry("bg").response) + size_of(_entry("bg").items) + 2
    store, _ = _store(budget=base + 2 * size_of(event) + 50)

    async def run() -> None:
        running = _entry("bg")
        running.running, running.events = True, []
        store.put("bg", running)
        await store.append("bg", event)
        await store.append("bg", event)
        waiting = asyncio.ensure_future(store.append("bg", event))
        await asyncio.sleep(0)
        assert not waiting.done()  # no room: the background reader waits
        assert len(running.events) == 2
        store.delete("bg")  # a delete frees it (and ends the wait)
        await asyncio.wait_for(waiting, 5)

    asyncio.run(run())
    assert len(store) == 0
    assert store.bytes == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        Store(-1, 10)
    with pytest.raises(InvalidArgument):
        Store(10, 0)
