"""``kill -9`` of the worker under ``tokenbelt serve`` (its default worker isolation).

One real server for the module, the real default model in its worker process, a real
``SIGKILL`` (and a ``SIGSTOP`` to hold a request between the pipe and the worker's
engine). Every dialect ends its stream with its own terminal event and tokenbelt's
exact reason; a request the dead worker had not admitted is served by the next one.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import plainhttp
from serving import serve_default_model
from tokenbelt.engines import HEARTBEAT_BOUND_S

pytestmark = pytest.mark.model

#: a safety net for every wait, never the assertion itself
NET = 30.0
SEA = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("kills")
    with serve_default_model(tmp, 90.0, ("--slots", "2", "--keep-alive", "0")) as base:
        yield base


def _worker(url: str) -> tuple[str, int]:
    """The model's name and its worker's pid, once a worker is ready."""
    deadline = time.monotonic() + NET
    while time.monotonic() < deadline:
        health = plainhttp.get(f"{url}/health", timeout=NET).json()
        ((name, worker),) = health["workers"].items()
        if worker["state"] == "ready" and worker["pid"]:
            return name, int(worker["pid"])
        time.sleep(0.05)
    raise AssertionError(f"no worker ready within {NET} s")


def _record(url: str, request_id: str) -> dict[str, object] | None:
    response = plainhttp.get(f"{url}/v1/requests/{request_id}", timeout=NET)
    return None if response.status_code == 404 else response.json()  # type: ignore[no-any-return]


def test_ollama_stream_ends_done_with_the_reason_and_a_waiting_request_is_served(
    url: str,
) -> None:
    name, pid = _worker(url)
    body = {"model": name, "messages": SEA, "options": {"num_predict": 400}}
    lines: list[dict[str, object]] = []
    answer: dict[str, object] = {}

    def waiting() -> None:
        # Sent while the worker is stopped: in its pipe, never admitted by its engine.
        one = {**body, "stream": False, "options": {"num_predict": 8, "temperature": 0}}
        response = plainhttp.post(
            f"{url}/api/chat", json=one, headers={"x-request-id": "waiting-1"}, timeout=NET
        )
        answer.update(status=response.status_code, body=response.json())

    helper = threading.Thread(target=waiting, daemon=True)
    with plainhttp.stream("POST", f"{url}/api/chat", json=body, timeout=NET) as response:
        for line in response.iter_lines():
            lines.append(json.loads(line))
            if len(lines) == 3:
                os.kill(pid, signal.SIGSTOP)
                helper.start()
                deadline = time.monotonic() + NET
                while (record := _record(url, "waiting-1")) is None or not record["worker"]:
                    assert time.monotonic() < deadline, "the waiting request was never sent"
                    time.sleep(0.02)
                assert record["timeline_ms"]["admitted"] is None  # type: ignore[index]
                os.kill(pid, signal.SIGKILL)
    helper.join(NET)
    # The stream: an error line, then Ollama's own last line with the exact reason.
    error, last = lines[-2], lines[-1]
    assert "engine worker killed by signal 9 (SIGKILL)" in str(error["error"])
    assert last["done"] is True
    assert last["done_reason"] == "runtime_error"
    assert last["tokenbelt"]["end_reason"] == "runtime_error"  # type: ignore[index]
    assert all(line["done"] is False for line in lines[:-2])
    # The request the dead worker had not admitted was served by the next one.
    assert answer["status"] == 200, answer
    served = answer["body"]
    assert served["done_reason"] == "length"  # type: ignore[index]
    trace = served["tokenbelt"]["trace"]  # type: ignore[index]
    assert trace["worker"]["pid"] not in (None, pid)
    assert trace["end_reason"] == "length"


def test_anthropic_stream_ends_with_message_delta_and_message_stop(url: str) -> None:
    name, pid = _worker(url)
    body = {"model": name, "messages": SEA, "max_tokens": 400, "stream": True}
    events: list[tuple[str, dict[str, object]]] = []
    with plainhttp.stream("POST", f"{url}/v1/messages", json=body, timeout=NET) as response:
        kind = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
                if kind == "content_block_delta" and len(events) == 4:
                    os.kill(pid, signal.SIGKILL)
    kinds = [k for k, _ in events]
    assert kinds[-4:] == ["content_block_stop", "error", "message_delta", "message_stop"], kinds
    error = events[-3][1]
    assert "engine worker killed by signal 9 (SIGKILL)" in error["error"]["message"]  # type: ignore[index]
    delta = events[-2][1]
    # A standard stop_reason (the reply was cut short), the exact reason beside it.
    assert delta["delta"]["stop_reason"] == "max_tokens"  # type: ignore[index]
    assert delta["tokenbelt"]["end_reason"] == "runtime_error"  # type: ignore[index]
    _worker(url)  # the next worker starts


def test_a_frozen_worker_is_not_ready_within_the_bound_and_ready_again_after(url: str) -> None:
    _name, pid = _worker(url)
    assert plainhttp.get(f"{url}/health/ready", timeout=NET).status_code == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        while (response := plainhttp.get(f"{url}/health/ready", timeout=NET)).status_code == 200:
            # the bound, plus a heartbeat's period and a poll
            assert time.monotonic() - stopped < HEARTBEAT_BOUND_S + 3.0, "still ready"
            time.sleep(0.1)
        # counted from its last answer, at most a heartbeat's period before the stop
        assert time.monotonic() - stopped >= HEARTBEAT_BOUND_S - 2.0
        body = response.json()
        assert response.status_code == 503
        assert body["status"] == "unresponsive"
        assert f"engine worker {pid} has answered no heartbeat" in body["reason"]
        (worker,) = body["workers"].values()
        assert worker["unresponsive_s"] >= HEARTBEAT_BOUND_S
    finally:
        os.kill(pid, signal.SIGCONT)
    continued = time.monotonic()
    while (response := plainhttp.get(f"{url}/health/ready", timeout=NET)).status_code != 200:
        assert time.monotonic() - continued < 5.0, response.text
        time.sleep(0.1)
    assert response.json()["status"] == "ok"
    assert _worker(url)[1] == pid  # the same worker: frozen, then thawed, never killed
