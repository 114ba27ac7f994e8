"""Routing between upstreams: least outstanding requests, limits, ejection, readmission."""

from __future__ import annotations

import asyncio

import pytest

from tokenbelt import InvalidArgument, Upstream, UpstreamUnavailable
from tokenbelt.engines import UpstreamPool


def pool(n: int = 2, limit: int = 2) -> UpstreamPool:
    return UpstreamPool(
        [Upstream(f"http://127.0.0.1:{9000 + i}", "m", max_concurrency=limit) for i in range(n)],
        backoff=0.5,
        max_backoff=2.0,
    )


@pytest.mark.anyio
async def test_least_outstanding_requests_first() -> None:
    p = pool()
    a = await p.acquire()
    b = await p.acquire()
    assert a is not b  # the idle one, not the busy one
    c = await p.acquire()
    assert c is a  # a tie: the one picked longest ago
    p.release(b)
    assert await p.acquire() is b  # b has none in flight now, a has two
    assert (a.in_flight, b.in_flight) == (2, 1)
    assert p.slots == 4


@pytest.mark.anyio
async def test_a_full_pool_waits_for_a_release() -> None:
    p = pool(n=1, limit=1)
    held = await p.acquire()
    waiting = asyncio.ensure_future(p.acquire())
    await asyncio.sleep(0)
    assert not waiting.done()
    p.release(held)
    assert await asyncio.wait_for(waiting, 5) is held
    # A cancelled wait counts nothing.
    blocked = asyncio.ensure_future(p.acquire())
    await asyncio.sleep(0)
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    assert held.in_flight == 1


@pytest.mark.anyio
async def test_ejection_backs_off_and_a_health_check_readmits() -> None:
    p = pool()
    a, b = p.states
    p.eject(a, "refused")
    assert a.ejected
    assert a.ejections == 1
    assert a.backoff == 0.5
    assert await p.acquire() is b
    assert await p.acquire() is b
    p.eject(b, "reset")
    with pytest.raises(UpstreamUnavailable, match="refused") as info:
        await p.acquire()
    assert "reset" in str(info.value)
    p.readmit(a)
    assert not a.ejected
    assert await p.acquire() is a
    # Consecutive ejections double the backoff up to the ceiling; a success resets it.
    a.ejected_until = 0.0
    p.eject(a, "again")
    assert a.backoff == 1.0
    a.ejected_until = 0.0
    p.eject(a, "again")
    a.ejected_until = 0.0
    p.eject(a, "again")
    assert a.backoff == 2.0
    p.succeeded(a, 0.01)
    assert a.backoff == 0.0
    assert a.statistics().ttft_count == 1


@pytest.mark.anyio
async def test_excluded_upstreams_are_not_retried() -> None:
    p = pool()
    a, b = p.states
    assert await p.acquire(exclude=[a]) is b
    with pytest.raises(UpstreamUnavailable, match="no upstream available"):
        await p.acquire(exclude=[a, b])


@pytest.mark.parametrize(
    ("url", "model", "limit", "problem"),
    [
        ("ftp://x", "m", 1, "http://"),
        ("http://", "m", 1, "http://"),
        ("http://x", "", 1, "name of its model"),
        ("http://x", "m", 0, "max_concurrency"),
    ],
)
def test_bad_upstreams_are_refused(url: str, model: str, limit: int, problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        Upstream(url, model, max_concurrency=limit)


def test_a_base_url_with_v1_is_the_same_upstream() -> None:
    assert Upstream("http://h:8000/v1/", "m").url == "http://h:8000"
