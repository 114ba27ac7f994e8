"""Health tells the truth: ready only when every model takes requests now or on demand.

``/health/live`` is 200 while the process serves; ``/health`` and ``/health/ready``
are 200 only when every model can take a request (an idle-unloaded model reloads on
demand and is ready), and 503 with the reason otherwise: loading, a failed load,
shutting down.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import plainhttp
from tokenbelt import Runtime
from tokenbelt.models import default_model_path
from tokenbelt.runtime import ModelState

from ..conftest import CHAT, NET, ServeFactory, chat_body


def _get(url: str) -> tuple[int, dict[str, Any]]:
    response = plainhttp.get(url, timeout=NET)
    return response.status_code, response.json()


def _wait_for_load(url: str) -> None:
    with httpx.Client(timeout=NET) as client:
        for _ in range(int(NET / 0.02)):
            if client.get(f"{url}/health").json()["status"] != "loading":
                return
            threading.Event().wait(0.02)
    raise AssertionError("the load never ended")


def test_a_failed_load_is_unhealthy_and_says_why(serve: ServeFactory, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 64)  # a header, no model
    served = serve(Runtime(keep_alive=None), load=str(broken))
    _wait_for_load(served.url)

    for path in ("/health", "/health/ready"):
        status, body = _get(f"{served.url}{path}")
        assert status == 503, body
        assert body["status"] == "failed"
        assert body["reason"].startswith("model broken failed to load: ")
        assert body["loads"]["broken"]["state"] == "failed"
    assert _get(f"{served.url}/health/live") == (200, {"status": "alive"})

    for request in (chat_body(model="broken"), chat_body()):
        response = plainhttp.post(f"{served.url}{CHAT}", json=request, timeout=NET)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "model_load_failed"
        assert error["message"].startswith("model broken failed to load: ")
        assert "llama.cpp could not load" in error["message"]


@pytest.mark.model
def test_an_idle_unloaded_model_is_healthy_and_a_burst_reloads_it_without_503(
    serve: ServeFactory,
) -> None:
    runtime = Runtime(keep_alive=None, slots=2, n_ctx=512)
    model = runtime.load(str(default_model_path()))
    served = serve(runtime)
    model.set_keep_alive(0)  # unloads the idle model before it returns
    assert model.state is ModelState.IDLE_UNLOADED

    status, body = _get(f"{served.url}/health")
    assert status == 200, body
    assert body["status"] == "ok"
    assert body["models"] == {model.name: "idle_unloaded"}

    burst = 6
    statuses: list[int] = []
    lock = threading.Lock()
    go = threading.Barrier(burst)

    def ask() -> None:
        go.wait(NET)
        response = plainhttp.post(
            f"{served.url}{CHAT}", json=chat_body("hi", max_tokens=2), timeout=NET
        )
        with lock:
            statuses.append(response.status_code)

    threads = [threading.Thread(target=ask) for _ in range(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(NET)
    assert statuses == [200] * burst
