"""The HTTP API refuses and accepts exactly the sampling values the SDK does."""

from __future__ import annotations

import pytest

import plainhttp
from tokenbelt import SamplingParams, ScriptedEngine
from tokenbelt.engines import SAMPLING_RANGES

from ..conftest import CHAT, NET, Served, ServeFactory, chat_body, scripted_runtime, words


@pytest.fixture
def served(serve: ServeFactory) -> Served:
    return serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))


def _edges(name: str) -> tuple[float, float]:
    """(just outside the range at its low end, its high end)."""
    low, high, included = SAMPLING_RANGES[name]
    return (low - 1 if included else low), high


@pytest.mark.parametrize("name", sorted(SAMPLING_RANGES))
def test_http_and_sdk_draw_the_same_lines(served: Served, name: str) -> None:
    below, high = _edges(name)
    above = high + 1
    for bad in (below, above):
        with pytest.raises(Exception, match=name):
            SamplingParams(**{name: bad})
        refused = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(**{name: bad}), timeout=NET)
        assert refused.status_code in (400, 422), refused.text
        assert refused.json()["error"]["param"] == name
    assert getattr(SamplingParams(**{name: high}), name) == high
    body = chat_body(**{name: high})
    if name != "max_tokens":
        body["max_tokens"] = 2
    accepted = plainhttp.post(f"{served.url}{CHAT}", json=body, timeout=NET)
    assert accepted.status_code == 200, accepted.text
