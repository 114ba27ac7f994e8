"""The runtime owns each request's bounds: an HTTP request that names none gets the
runtime's own capacity and deadlines; ``ServerSettings`` only overrides when it is set."""

from __future__ import annotations

from typing import Any

import plainhttp
from tokenbelt import EndReason, Limits, Runtime, ScriptedEngine
from tokenbelt._defaults import DEFAULT_CAPACITY
from tokenbelt.server import ServerSettings

from ..conftest import CHAT, NET, ServeFactory, chat_body, collect, words


def _runtime(**options: Any) -> Runtime:
    runtime = Runtime(keep_alive=None, **options)
    runtime.add_engines("scripted", [ScriptedEngine(words(3), delay=0)])
    return runtime


def _capacities(url: str, **extra: Any) -> set[int]:
    """The belt capacity every chunk of one streamed chat reports."""
    body = chat_body(stream=True, **extra)
    with plainhttp.stream("POST", f"{url}{CHAT}", json=body, timeout=NET) as response:
        assert response.status_code == 200
        events = collect(response.iter_lines())
    return {e["tokenbelt"]["capacity"] for e in events[:-1] if e["choices"][0]["delta"]}


def test_a_request_without_capacity_gets_the_runtimes_own(serve: ServeFactory) -> None:
    served = serve(_runtime(capacity=3))
    assert _capacities(served.url) == {3}
    # Its own still wins.
    assert _capacities(served.url, tokenbelt={"capacity": 2}) == {2}


def test_the_runtimes_default_capacity_is_the_shared_default(serve: ServeFactory) -> None:
    served = serve(_runtime())
    assert _capacities(served.url) == {DEFAULT_CAPACITY}


def test_a_server_capacity_overrides_the_runtimes_only_when_set(serve: ServeFactory) -> None:
    served = serve(_runtime(capacity=3), ServerSettings(capacity=5))
    assert _capacities(served.url) == {5}


def test_a_request_without_deadlines_gets_the_runtimes_own(serve: ServeFactory) -> None:
    runtime = Runtime(keep_alive=None, limits=Limits(first_token=0.2))
    runtime.add_engines("scripted", [ScriptedEngine(words(5), prefill_delay=NET)])
    served = serve(runtime)
    response = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(), timeout=NET)
    assert response.status_code == 504
    reason = EndReason.FIRST_TOKEN_TIMEOUT
    assert response.json()["tokenbelt"]["end_reason"] == reason.value
    served.assert_released(served.recorder.by_id(response.headers["x-request-id"]), reason)
