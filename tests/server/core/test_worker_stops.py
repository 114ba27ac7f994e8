"""``tokenbelt serve`` (worker isolation): a stop never needs the worker killed.

A real server, the real default model in its worker process, raw sockets that send a
non-streamed request and reset the connection (RST) once it decodes, beside a stream.
The worker's test point ``slow_stop`` makes the step a stop lands in run for seconds,
as steps do on a machine whose cores are busy: the stop is still released within a
step's bound (the engine aborts the long step), the worker is never killed, and the
stream beside it goes on.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

import plainhttp
import races
from serving import serve_default_model
from tokenbelt.engines import ABORT_ENV

pytestmark = pytest.mark.model

#: a safety net for every wait, never the assertion itself
NET = 30.0
#: the worker's stop grace for this server: a stop later than this kills the worker
GRACE_S = 1.0
SEA = [{"role": "user", "content": "Tell me about the sea."}]


def _record(url: str, request_id: str) -> dict[str, object] | None:
    response = plainhttp.get(f"{url}/v1/requests/{request_id}", timeout=NET)
    if response.status_code == 404:
        return None
    body: dict[str, object] = response.json()
    return body


def _poll(url: str, request_id: str, ready: str) -> dict[str, object]:
    """The request's record once ``timeline_ms[ready]`` is set (under the net)."""
    deadline = time.monotonic() + NET
    while time.monotonic() < deadline:
        body = _record(url, request_id)
        if body is not None:
            timeline = body["timeline_ms"]
            assert isinstance(timeline, dict)
            if timeline[ready] is not None:
                return body
        time.sleep(0.02)
    raise AssertionError(f"{request_id}: no {ready} within {NET} s")


def _reset_during_decode(url: str, name: str, request_id: str) -> None:
    """Send a non-streamed chat request, wait until it decodes, reset the connection."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": name, "messages": SEA, "max_tokens": 200}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nx-request-id: {request_id}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=NET) as s:
        s.sendall(head + body)
        _poll(url, request_id, "first_token")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _restarts(url: str) -> float:
    text = plainhttp.get(f"{url}/metrics", timeout=NET).text
    (line,) = [x for x in text.splitlines() if x.startswith("tokenbelt_worker_restarts_total")]
    return float(line.rsplit(" ", 1)[1])


def test_non_streamed_resets_in_long_steps_never_kill_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ABORT_ENV, "slow_stop")
    extra = ("--slots", "2", "--stop-grace", str(GRACE_S), "--keep-alive", "0")
    with serve_default_model(tmp_path, 90.0, extra) as url:
        (name,) = plainhttp.get(f"{url}/health", timeout=NET).json()["models"]

        def stream() -> None:
            body = {"model": name, "messages": SEA, "max_tokens": 1500, "stream": True}
            with plainhttp.stream(
                "POST", f"{url}/v1/chat/completions", json=body, timeout=NET
            ) as response:
                for _line in response.iter_lines():
                    if stop_stream.is_set():
                        return

        stop_stream = threading.Event()
        beside = threading.Thread(target=stream, daemon=True)
        beside.start()
        ids = [f"reset-{i}" for i in range(3)]
        try:
            for request_id in ids:
                # Each reset lands in a step it shares with the stream, which the
                # ``slow_stop`` point makes last seconds.
                _reset_during_decode(url, name, request_id)
                record = _poll(url, request_id, "released")
                assert record["end_reason"] == "client_disconnect"
                problem = races.stop_released_in_time(record, step_s=0.0, bound_s=0.5)
                assert problem is None, problem
                assert record["worker"] is not None
                assert "killed" not in record["worker"]  # type: ignore[operator]
            assert _restarts(url) == 0
            assert beside.is_alive(), "the stream beside the stops ended"
        finally:
            stop_stream.set()
            beside.join(NET)
        log = (tmp_path / "serve.log").read_text()
        assert "not honoured" not in log
