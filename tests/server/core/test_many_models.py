"""Several models on one server under one memory budget: eviction of idle models (least
recently used first), pins, models busy with a stream, models that can never fit,
one load for a burst of first requests, and two models decoding at once.

The real default model under two aliases (``tokenbelt models add``), each loaded in its
own worker process; each test serves them from a server on 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import plainhttp
from tokenbelt import ModelState, Runtime
from tokenbelt.cli import main as cli
from tokenbelt.models import default_model_path

from ..conftest import NET, Served, ServeFactory

pytestmark = pytest.mark.model

MIB = 1 << 20
#: what one alias needs here (slots 1, n_ctx 512, the prefix cache): about 355 MiB
ONE_MODEL = 500 * MIB
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def aliases() -> list[str]:
    path = str(default_model_path())
    for alias in ("a", "b"):
        assert cli(["models", "add", path, "--alias", alias]) == 0
    return ["a", "b"]


def runtime_for(aliases: list[str], budget: int | None, **pins: bool) -> Runtime:
    # The budgets here are sized for two small models: their prefix caches at 4,096
    # tokens, not the default gibibyte each (the estimate counts what a cache may hold).
    runtime = Runtime(
        isolation="process",
        memory_budget=budget,
        slots=1,
        n_ctx=512,
        keep_alive=None,
        cache_tokens=4096,
    )
    for alias in aliases:
        runtime.load(alias, lazy=True, pin=pins.get(alias, False))
    return runtime


def chat(served: Served, model: str, net: float = NET, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": HI, "max_tokens": 4, "temperature": 0, **extra}
    return plainhttp.post(f"{served.url}/v1/chat/completions", json=body, timeout=net)


def refusals(served: Served, model: str) -> dict[str, httpx.Response]:
    """The same request for ``model`` in each dialect."""
    url = served.url
    return {
        "openai": chat(served, model),
        "ollama": plainhttp.post(
            f"{url}/api/chat",
            json={"model": model, "messages": HI, "stream": False},
            timeout=NET,
        ),
        "anthropic": plainhttp.post(
            f"{url}/v1/messages",
            json={"model": model, "messages": HI, "max_tokens": 4},
            timeout=NET,
        ),
    }


def message_of(dialect: str, response: httpx.Response) -> str:
    body = response.json()
    if dialect == "ollama":
        return str(body["error"])
    if dialect == "anthropic":
        assert body["type"] == "error"
    return str(body["error"]["message"])


def status_of(served: Served, name: str) -> dict[str, Any]:
    health = plainhttp.get(f"{served.url}/health", timeout=NET).json()
    status: dict[str, Any] = health["model_status"][name]
    return status


def test_a_budget_for_one_model_evicts_the_idle_one_each_way(
    serve: ServeFactory, aliases: list[str]
) -> None:
    served = serve(runtime_for(aliases, ONE_MODEL))
    a, b = (served.model(n) for n in aliases)
    assert chat(served, "a").status_code == 200
    assert a.state is ModelState.READY

    assert chat(served, "b").status_code == 200  # B evicts idle A, and is served
    assert (a.state, b.state) == (ModelState.IDLE_UNLOADED, ModelState.READY)
    assert "to make room for b" in str(status_of(served, "a")["unloaded_because"])
    assert chat(served, "a").status_code == 200  # and A's next request evicts B
    assert (a.state, b.state) == (ModelState.READY, ModelState.IDLE_UNLOADED)
    assert (a.loads, a.evictions, b.loads, b.evictions) == (2, 1, 1, 1)

    health = plainhttp.get(f"{served.url}/health", timeout=NET).json()
    assert health["memory"]["budget_bytes"] == ONE_MODEL
    assert 0 < health["memory"]["used_bytes"] <= ONE_MODEL
    memory = health["model_status"]["a"]["memory"]
    assert memory["measured_bytes"] > memory["weights_bytes"] > 0  # its worker's RSS
    ps = plainhttp.get(f"{served.url}/api/ps", timeout=NET).json()["models"]
    assert [m["name"] for m in ps] == ["a"]
    assert ps[0]["size"] == memory["total_bytes"]
    metrics = plainhttp.get(f"{served.url}/metrics", timeout=NET).text
    assert 'tokenbelt_model_evictions_total{model="a"} 1.0' in metrics
    assert 'tokenbelt_model_memory_bytes{model="a",part="weights"}' in metrics


def test_a_pinned_model_is_never_evicted_and_the_other_is_refused_with_the_reason(
    serve: ServeFactory, aliases: list[str]
) -> None:
    served = serve(runtime_for(aliases, ONE_MODEL, a=True))
    assert chat(served, "a").status_code == 200
    for dialect, response in refusals(served, "b").items():
        assert response.status_code == 507, (dialect, response.text)
        text = message_of(dialect, response)
        assert "memory budget is 500 MiB" in text, (dialect, text)
        assert "a (pinned)" in text, (dialect, text)
    assert served.model("a").state is ModelState.READY
    assert served.model("b").loads == 0
    health = plainhttp.get(f"{served.url}/health", timeout=NET)
    assert health.status_code == 503  # b cannot be served while the pin holds
    assert health.json()["status"] == "failed"
    assert "model b: " in health.json()["reason"]
    # A pinned model is kept loaded: a client's keep_alive 0 cannot unload it.
    unload = {"model": "a", "prompt": "", "keep_alive": 0}
    refused = plainhttp.post(f"{served.url}/api/generate", json=unload, timeout=NET)
    assert refused.status_code == 400, refused.text
    assert "pinned" in refused.json()["error"]
    assert served.model("a").state is ModelState.READY
    assert served.model("a").keep_alive is None  # no idle unload either


def test_a_model_with_a_stream_in_flight_is_not_evicted_under_it(
    serve: ServeFactory, aliases: list[str]
) -> None:
    served = serve(runtime_for(aliases, ONE_MODEL))
    body = {"model": "a", "messages": HI, "max_tokens": 200, "stream": True}
    with plainhttp.stream(
        "POST", f"{served.url}/v1/chat/completions", json=body, timeout=NET
    ) as streaming:
        lines = streaming.iter_lines()
        assert next(lines).startswith("data:")  # A is streaming now
        refused = chat(served, "b")
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "memory_budget_busy"
        assert "a (busy)" in refused.json()["error"]["message"]
        assert served.model("a").state is ModelState.READY
    # The client left: once A's request is released, B fits by evicting it.
    deadline = time.monotonic() + NET
    while served.model("a").busy():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert chat(served, "b").status_code == 200


def test_a_model_larger_than_the_budget_is_refused_at_once_in_every_dialect(
    serve: ServeFactory, aliases: list[str]
) -> None:
    served = serve(runtime_for(aliases, 200 * MIB))
    started = time.monotonic()
    for dialect, response in refusals(served, "a").items():
        assert response.status_code == 507, (dialect, response.text)
        text = message_of(dialect, response)
        assert "can never be loaded here" in text, (dialect, text)
        assert "200 MiB" in text, (dialect, text)
    assert time.monotonic() - started < 10  # no load was tried: nothing to wait for
    assert served.model("a").loads == 0
    assert "can never be loaded" in str(status_of(served, "a")["unloaded_because"])


def test_ten_concurrent_first_requests_cause_exactly_one_load(
    serve: ServeFactory, aliases: list[str]
) -> None:
    served = serve(runtime_for(aliases, None))
    b = served.model("b")
    assert b.state is ModelState.IDLE_UNLOADED
    assert b.loads == 0
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        codes = list(pool.map(lambda _: chat(served, "b").status_code, range(10)))
    assert codes == [200] * 10
    assert b.loads == 1
    (engine,) = b.engines
    worker = engine.statistics().worker
    assert worker is not None
    assert worker.restarts == 0


def test_two_models_decoding_at_once_both_progress(serve: ServeFactory, aliases: list[str]) -> None:
    served = serve(runtime_for(aliases, None))
    for name in aliases:
        assert chat(served, name).status_code == 200  # both loaded first
    times: dict[str, list[float]] = {name: [] for name in aliases}
    go = threading.Barrier(len(aliases))

    def stream(name: str) -> None:
        body = {"model": name, "messages": HI, "max_tokens": 48, "stream": True}
        body |= {"temperature": 0, "ignore_eos": True}
        go.wait(NET)
        url = f"{served.url}/v1/chat/completions"
        with plainhttp.stream("POST", url, json=body, timeout=NET) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    times[name].append(time.monotonic())

    with concurrent.futures.ThreadPoolExecutor(len(aliases)) as pool:
        list(pool.map(stream, aliases))
    a, b = (times[n] for n in aliases)
    assert len(a) > 40
    assert len(b) > 40
    # Each got tokens while the other was still streaming: neither waited its turn.
    assert sum(b[0] < t < b[-1] for t in a) > 10
    assert sum(a[0] < t < a[-1] for t in b) > 10


def test_a_long_prefix_survives_an_eviction_and_the_next_turn_reuses_it(
    serve: ServeFactory, aliases: list[str], tmp_path: Path
) -> None:
    runtime = Runtime(
        isolation="process",
        memory_budget=ONE_MODEL,
        slots=1,
        n_ctx=2048,
        keep_alive=None,
        cache_tokens=4096,  # as runtime_for's
        prefix_cache_dir=tmp_path / "prefix-cache",
    )
    for alias in aliases:
        runtime.load(alias, lazy=True)
    served = serve(runtime)
    # About 1,500 tokens of conversation before the user's turn.
    system = " ".join(
        f"Fact {i}: the harbour light number {i} is painted blue." for i in range(110)
    )
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "Which colour?"}]
    # A safety net, not a bound: a load and a 1,500-token prompt on one core of a busy
    # machine (a test worker's share) took longer than NET.
    long_net = 4 * NET
    first = chat(served, "a", long_net, messages=turn).json()
    assert first["usage"]["prompt_tokens"] > 1400
    assert chat(served, "b").status_code == 200  # A is evicted (and its cache saved)
    assert served.model("a").state is ModelState.IDLE_UNLOADED

    reply = first["choices"][0]["message"]["content"]
    turn += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Sure?"}]
    second = chat(served, "a", long_net, messages=turn).json()  # B is evicted, A loads its cache
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 1400, second["usage"]
