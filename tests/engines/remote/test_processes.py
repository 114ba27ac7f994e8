"""Upstreams that die and come back, a ``tokenbelt serve --upstream`` front, and
llama-cpp-python's own server as an upstream: each a real process on 127.0.0.1."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import plainhttp
from engines.remote.processes import Process, front_process, running, scripted_upstream
from server.conftest import CHAT, NET, RawClient, chat_body, collect
from serving import free_port
from tokenbelt import EndReason, Runtime, UpstreamUnavailable
from tokenbelt.models import default_model_path


def _requests_at(url: str) -> list[dict[str, object]]:
    data: list[dict[str, object]] = plainhttp.get(f"{url}/v1/requests", timeout=NET).json()["data"]
    return data


def test_a_killed_upstream_is_ejected_and_comes_back(tmp_path: Path) -> None:
    a, b = scripted_upstream(tmp_path), scripted_upstream(tmp_path)
    with running(a, b), Runtime(keep_alive=None) as rt:
        (model,) = rt.add_upstreams([a.url, b.url], health_interval=0.2, backoff=0.2)
        engine = model.engines[0]
        first = model.stream([{"role": "user", "content": "one"}], max_tokens=400)
        second = model.stream([{"role": "user", "content": "two"}], max_tokens=400)
        pieces = iter(first)
        next(pieces)
        # Least outstanding requests: one on each upstream.
        assert sorted(u.in_flight for u in engine.upstreams()) == [1, 1]  # type: ignore[attr-defined]
        on_a = any(t["request_id"] == first.request_id for t in _requests_at(a.url))
        victim, survivor = (a, b) if on_a else (b, a)
        victim.kill()
        with pytest.raises(UpstreamUnavailable, match=r"broke off|closed the stream"):
            for _ in pieces:
                pass
        assert first.end_reason is EndReason.RUNTIME_ERROR
        assert first.trace.error is not None
        assert victim.url in first.trace.error
        second.cancel()
        stats = {u.url: u for u in engine.upstreams()}  # type: ignore[attr-defined]
        assert stats[victim.url].ejected
        assert stats[victim.url].ejections == 1
        # New requests go to the survivor while the victim is out.
        for _ in range(3):
            reply = model.complete([{"role": "user", "content": "again"}], max_tokens=3)
            assert reply.end_reason is EndReason.LENGTH
            assert reply.trace.upstream is not None
            assert reply.trace.upstream["url"] == survivor.url
        # Restarted on the same port: the health check takes it back in.
        victim.start()
        deadline = time.monotonic() + NET
        while {u.url: u for u in engine.upstreams()}[victim.url].ejected:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the restarted upstream was not taken back"
            time.sleep(0.05)
        hits = set()
        for _ in range(4):
            reply = model.complete([{"role": "user", "content": "spread"}], max_tokens=3)
            assert reply.trace.upstream is not None
            hits.add(reply.trace.upstream["url"])
        assert hits == {a.url, b.url}


def test_serve_upstream_front_process(tmp_path: Path) -> None:
    up = scripted_upstream(tmp_path)
    fr = front_process(tmp_path, up.url)
    with running(up, fr):
        models = plainhttp.get(f"{fr.url}/v1/models", timeout=NET).json()["data"]
        assert [m["id"] for m in models if m["tokenbelt"]["loaded"]] == ["scripted"]
        body = chat_body(max_tokens=5)
        answer = plainhttp.post(fr.url + CHAT, json=body, timeout=NET).json()
        assert answer["choices"][0]["message"]["content"] == " w0 w1 w2 w3 w4"
        # A client that leaves the front: the upstream process records the disconnect.
        with RawClient(fr.url) as client:
            client.send(CHAT, chat_body(stream=True, max_tokens=400))
            client.read_head()
            request_id = client.headers["x-request-id"]
            client.read_until(b" w3")
        deadline = time.monotonic() + NET
        while True:
            trace = plainhttp.get(f"{up.url}/v1/requests/{request_id}", timeout=NET).json()
            if trace.get("timeline_ms", {}).get("released") is not None:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert trace["end_reason"] == "client_disconnect"
        metrics = plainhttp.get(f"{fr.url}/metrics", timeout=NET).text
        assert f'tokenbelt_upstream_requests_total{{model="scripted",upstream="{up.url}"}}' in (
            metrics
        )


def test_models_add_remote_and_load(tmp_path: Path) -> None:
    import subprocess

    up = scripted_upstream(tmp_path)
    with running(up):
        command = [sys.executable, "-m", "tokenbelt", "models", "add-remote", "far"]
        command += ["--url", up.url, "--model", "scripted"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=NET)
        assert done.returncode == 0, done.stderr
        again = subprocess.run(command, capture_output=True, text=True, timeout=NET)
        assert again.returncode != 0
        assert "already in the catalog" in again.stderr
        assert len(again.stderr.strip().splitlines()) == 1
        listed = subprocess.run(
            [sys.executable, "-m", "tokenbelt", "models", "list", "--json"],
            capture_output=True,
            text=True,
            timeout=NET,
        )
        (remote,) = json.loads(listed.stdout)["remote"]
        assert (remote["alias"], remote["url"], remote["model"]) == ("far", up.url, "scripted")
        with Runtime(keep_alive=None) as rt:
            model = rt.load("far")
            reply = model.complete([{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.text == " w0 w1"
        # `tokenbelt serve NAME` serves it as well.
        port = free_port()
        command = [sys.executable, "-m", "tokenbelt", "serve", "far", "--port", str(port)]
        served = Process(command, f"http://127.0.0.1:{port}", tmp_path / "far.log", "/health")
        with running(served):
            # Up before the model: `serve` registers it in the background.
            deadline = time.monotonic() + NET
            while plainhttp.get(f"{served.url}/health", timeout=NET).json()["status"] != "ok":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            body = chat_body(max_tokens=3)
            answer = plainhttp.post(served.url + CHAT, json=body, timeout=NET).json()
            assert answer["model"] == "far"
            assert answer["choices"][0]["message"]["content"] == " w0 w1 w2"


#: a prompt whose answer is long: a server that did not stop would be busy for a while
COUNT = "Count from 1 to 1000, one number per line."


#: runs llama-cpp-python's server with weights in the plain CPU layout: on a CPU with AMX
#: llama.cpp's AMX kernel segfaults on any prompt (see ``engines.llama.model_params``)
LAUNCH_LLAMA_SERVER = """
import llama_cpp.llama_cpp
from llama_cpp.server.__main__ import main
from tokenbelt.engines.llama import model_params
llama_cpp.llama_cpp.llama_model_default_params = model_params
main()
"""


def llama_server(tmp: Path) -> Process:
    port = free_port()
    command = [sys.executable, "-c", LAUNCH_LLAMA_SERVER, "--model", str(default_model_path())]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"]
    # By default it cuts a running stream short (a bare [DONE]) when any other request
    # arrives, a front's health check included.
    command += ["--n_threads", "1", "--model_alias", "smol", "--interrupt_requests", "False"]
    return Process(command, f"http://127.0.0.1:{port}", tmp / "llama.log", "/v1/models")


def test_llama_cpp_python_server_as_upstream(tmp_path: Path) -> None:
    pytest.importorskip("sse_starlette")
    server = llama_server(tmp_path)
    with running(server), Runtime(keep_alive=None) as rt:
        (model,) = rt.add_upstreams([server.url], max_concurrency=1, health_interval=None)
        assert model.name == "smol"
        reply = model.complete([{"role": "user", "content": "Say hi"}], max_tokens=8)
        assert reply.end_reason in (EndReason.STOP, EndReason.LENGTH)
        assert reply.text
        assert reply.usage.completion_tokens > 0
        assert reply.trace.upstream is not None
        assert reply.trace.upstream["release"] == "finished"
        # Through the SDK's stream: stop after two pieces; the upstream is free again
        # for the next request at once (its request starts promptly).
        stream = model.stream([{"role": "user", "content": COUNT}], max_tokens=1500)
        pieces = iter(stream)
        next(pieces)
        next(pieces)
        stream.cancel()
        assert stream.wait_released(NET)
        # Closed, but that server keeps no record a front could read: not claimed.
        assert stream.trace.upstream is not None
        assert stream.trace.upstream["release"] == "unconfirmed"
        assert stream.trace.upstream["kind"] == "llama-cpp-python"
        assert "keeps no record" in stream.trace.upstream["release_why"]
        started = time.monotonic()
        follow = model.stream([{"role": "user", "content": "Say hi"}], max_tokens=2)
        next(iter(follow))
        ttft = time.monotonic() - started
        follow.read()
        # Not a timing target: a server that decoded the rest of the 1,500 tokens first
        # would take far longer.
        assert ttft < 10.0, ttft
        # A JSON schema reaches it as tokenbelt's grammar (its ``grammar`` field).
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        shaped = model.complete([{"role": "user", "content": "A number"}], schema=schema)
        assert isinstance(json.loads(shaped.text)["n"], int)


def test_llama_cpp_python_server_streams_through_a_front(tmp_path: Path) -> None:
    pytest.importorskip("sse_starlette")
    server = llama_server(tmp_path)
    with running(server):
        fr = front_process(tmp_path, server.url, extra=["--upstream-concurrency", "1"])
        # (its health checks wait while a stream runs: llama-cpp-python serves one at a time)
        with running(fr):
            body = chat_body("Say hi", stream=True, max_tokens=8)
            body["model"] = "smol"
            with plainhttp.stream("POST", fr.url + CHAT, json=body, timeout=NET) as response:
                events = collect(response.iter_lines())
            assert events[-1] == "[DONE]"
            reason = events[-2]["tokenbelt"]["end_reason"]
            assert reason in ("stop", "length"), json.dumps(events[-2])
            answer = plainhttp.post(fr.url + CHAT, json={**body, "stream": False}, timeout=NET)
            assert answer.status_code == 200, answer.text
            # A client that leaves the front two pieces into a long answer: the upstream
            # (one request at a time here) starts the next request without finishing it.
            long = {**body, "messages": [{"role": "user", "content": COUNT}]}
            with RawClient(fr.url) as client:
                client.send(CHAT, {**long, "max_tokens": 1500})
                client.read_head()
                client.read_until(b'"content"')
            started = time.monotonic()
            answer = plainhttp.post(fr.url + CHAT, json={**body, "stream": False}, timeout=NET)
            assert answer.status_code == 200, answer.text
            trace = answer.json()["tokenbelt"]["trace"]
            assert trace["time_to_first_token_ms"] is not None
            # Not a timing target: a server that decoded the 1,500 tokens first would take
            # far longer; this is the next request starting once the stop has landed.
            assert time.monotonic() - started < 10.0


def test_sigterm_to_a_front_ends_its_streams_and_closes_the_upstream_connection(
    tmp_path: Path,
) -> None:
    up = scripted_upstream(tmp_path, tokens=100_000)
    fr = front_process(tmp_path, up.url, extra=["--shutdown-grace", "20"])
    with running(up, fr):
        with RawClient(fr.url) as client:
            client.send(CHAT, chat_body(stream=True, max_tokens=100_000))
            client.read_head()
            request_id = client.headers["x-request-id"]
            client.read_until(b" w3")
            assert fr.process is not None
            fr.process.terminate()  # SIGTERM
            assert fr.process.wait(NET) == 0, fr.log.read_text()
            events = [e for e in collect(client.read_to_close().decode().splitlines())]
        assert events[-1] == "[DONE]"
        assert events[-2]["tokenbelt"]["end_reason"] == "shutdown"
        # The front closed its upstream connection: the upstream saw its client leave.
        deadline = time.monotonic() + NET
        while True:
            trace = plainhttp.get(f"{up.url}/v1/requests/{request_id}", timeout=NET).json()
            if trace.get("timeline_ms", {}).get("released") is not None:
                break
            assert time.monotonic() < deadline, trace
            time.sleep(0.02)
        assert trace["end_reason"] == "client_disconnect"
        assert "Traceback" not in fr.log.read_text()
