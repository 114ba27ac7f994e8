"""``tokenbelt serve --isolation process``: a worker crash ends streams, not the service.

A real ``tokenbelt serve`` process, the real default model in its worker process, the
``openai`` SDK as the client and a real ``SIGKILL``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import openai
import psutil
import pytest

import plainhttp
from niceness import niceness
from serving import serve, serve_default_model

pytestmark = pytest.mark.model

#: a safety net for every wait, never the assertion itself
NET = 30.0
SEA = [{"role": "user", "content": "Tell me about the sea."}]
HELLO = [{"role": "user", "content": "Say hello."}]


def test_kill_9_of_the_worker_mid_stream_over_http(tmp_path: Path) -> None:
    extra = ("--isolation", "process", "--keep-alive", "0")
    with serve_default_model(tmp_path, 90.0, extra) as url:
        health = plainhttp.get(f"{url}/health", timeout=NET).json()
        (name,) = health["models"]
        worker = health["workers"][name]
        assert worker["state"] == "ready"
        assert worker["restarts"] == 0
        pid = worker["pid"]
        server = psutil.Process(pid).parent()
        assert server is not None
        body = {"model": name, "messages": SEA, "max_tokens": 400, "temperature": 0}
        events: list[str] = []
        with plainhttp.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=NET
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    os.kill(pid, signal.SIGKILL)
        # A final chunk that says why, then [DONE].
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])
        assert final["choices"][0]["finish_reason"] is not None
        assert final["tokenbelt"]["end_reason"] == "runtime_error"
        assert "engine worker killed by signal 9 (SIGKILL)" in final["error"]["message"]
        assert final["tokenbelt"]["trace"]["worker"]["pid"] == pid

        assert server.is_running()  # the service lives on
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=NET)
        reply = client.chat.completions.create(
            model=name,
            messages=HELLO,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
        assert reply.choices[0].message.content
        health = plainhttp.get(f"{url}/health", timeout=NET).json()
        (worker,) = health["workers"].values()
        assert worker["restarts"] == 1
        assert worker["last_crash"] == "engine worker killed by signal 9 (SIGKILL)"
        assert worker["pid"] != pid
        assert worker["rss_bytes"] > 0

        # The OpenAI SDK reports the crash as an error with its cause.
        stream = client.chat.completions.create(
            model=name,
            messages=SEA,  # type: ignore[arg-type]
            max_tokens=400,
            temperature=0,
            stream=True,
        )
        pieces = iter(stream)
        next(pieces)
        os.kill(worker["pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError, match=r"engine worker killed by signal 9"):
            list(pieces)
        assert server.is_running()
        reply = client.chat.completions.create(
            model=name,
            messages=HELLO,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content
        worker = plainhttp.get(f"{url}/health", timeout=NET).json()["workers"][name]
        assert worker["restarts"] == 2
        metrics = plainhttp.get(f"{url}/metrics", timeout=NET).text
        assert "tokenbelt_worker_restarts_total" in metrics
        assert 'cause="engine worker killed by signal 9 (SIGKILL)"' in metrics
        assert f'tokenbelt_worker_pid{{model="{name}"}} {float(worker["pid"])}' in metrics
    # The service ended (SIGTERM): its worker went with it.
    deadline = time.monotonic() + NET
    while psutil.pid_exists(worker["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(worker["pid"])


def test_serve_decode_nice_reaches_the_worker_s_decode_threads_only(tmp_path: Path) -> None:
    """``--decode-nice 3``: the worker's engine thread and llama.cpp's threads run 3
    nicer; its main thread (the one that reads stops) and every thread of the server
    keep their priority."""
    extra = ("--isolation", "process", "--decode-nice", "3", "--threads", "2")
    with serve_default_model(tmp_path, 90.0, extra) as url:
        health = plainhttp.get(f"{url}/health", timeout=NET).json()
        (name,) = health["models"]
        pid = health["workers"][name]["pid"]
        body = {"model": name, "messages": HELLO, "max_tokens": 4}
        assert plainhttp.post(f"{url}/v1/chat/completions", json=body, timeout=NET).is_success
        base = os.getpriority(os.PRIO_PROCESS, 0)
        worker = niceness(pid)
        assert worker[pid] == base
        assert sum(1 for nice in worker.values() if nice == base + 3) >= 2, worker
        server = psutil.Process(pid).parent()
        assert server is not None
        assert set(niceness(server.pid).values()) == {base}


def test_a_sigterm_to_the_process_group_shuts_down_without_a_worker_crash(
    tmp_path: Path,
) -> None:
    """A service manager's stop (systemd: SIGTERM to every process of the unit) reaches
    the worker too: it waits for the server to end it instead of dying first, which the
    server logged as a crash and answered with a restart during its own shutdown. A
    SIGTERM to the worker alone is said in the log and changes nothing."""
    flags = ("--isolation", "process")
    with serve(tmp_path, flags=flags, log_level="info", new_session=True) as (url, server):
        health = plainhttp.get(f"{url}/health", timeout=NET).json()
        (name,) = health["models"]
        pid = health["workers"][name]["pid"]
        os.kill(pid, signal.SIGTERM)
        body = {"model": name, "messages": HELLO, "max_tokens": 4}
        assert plainhttp.post(f"{url}/v1/chat/completions", json=body, timeout=NET).is_success
        worker = plainhttp.get(f"{url}/health", timeout=NET).json()["workers"][name]
        assert (worker["pid"], worker["restarts"]) == (pid, 0)
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(NET) == 0, (tmp_path / "serve.log").read_text()
    text = (tmp_path / "serve.log").read_text()
    assert f"engine worker {pid}: SIGTERM ignored" in text
    assert "killed by signal" not in text, text
    assert "engine worker" not in text.replace(f"engine worker {pid}", ""), text  # no other
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
