"""``tokenbelt serve`` stops work on SIGTERM and Ctrl-C: a real process, real clients.

Two streams run and one waits in the queue when the signal comes: each gets its final
chunk with end reason ``shutdown`` and ``[DONE]``, the process exits 0 within the
grace period, and nothing on stderr is a traceback. A second signal exits at once.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import plainhttp
from serving import free_port
from tokenbelt.engines import load_vocab
from tokenbelt.models import default_model_path

NET_S = 60.0
GRACE_S = 20.0


def _end_tokens() -> list[int]:
    """The default model's end-of-generation tokens, read from its vocabulary."""
    import llama_cpp

    model = load_vocab(default_model_path())
    try:
        n = llama_cpp.llama_vocab_n_tokens(model.vocab)
        return [t for t in range(n) if llama_cpp.llama_vocab_is_eog(model.vocab, t)]
    finally:
        model.close()


END_TOKENS = _end_tokens()


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def text(self) -> str:
        return self.log.read_text()

    def wait_for_line(self, needle: str) -> None:
        deadline = time.monotonic() + NET_S
        while needle not in self.text():
            assert self.process.poll() is None or needle in self.text(), self.text()
            assert time.monotonic() < deadline, f"no {needle!r} in:\n{self.text()}"
            time.sleep(0.05)


@contextlib.contextmanager
def running_server(tmp_path: Path, *flags: str) -> Iterator[Server]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "tokenbelt", "serve", str(default_model_path())]
    command += ["--port", str(port), "--log-level", "info", *flags]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, url, log)
    try:
        deadline = time.monotonic() + NET_S
        while True:
            assert process.poll() is None, server.text()
            with contextlib.suppress(httpx.HTTPError):
                if plainhttp.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, server.text()
            time.sleep(0.1)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@dataclass
class Reader:
    """One streamed chat completion read on a thread, event by event."""

    url: str
    events: list[Any] = field(default_factory=list)
    status: int | None = None
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "Count from one to one thousand."}],
            "max_tokens": 3000,
            # The default model's end-of-generation tokens, banned: a reply that ended on
            # its own would free its slot, and the third request would never queue.
            "logit_bias": {str(token): -100 for token in END_TOKENS},
            "stream": True,
        }
        try:
            with plainhttp.stream(
                "POST", f"{self.url}/v1/chat/completions", json=body, timeout=NET_S
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        if data != "[DONE]" and self.events[-1]["choices"]:
                            self.started.set()
        except BaseException as exc:
            self.error = exc


def _queued(url: str) -> int:
    traces = plainhttp.get(f"{url}/v1/requests", timeout=NET_S).json()["data"]
    return sum(1 for t in traces if t["timeline_ms"]["admitted"] is None)


@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_running_and_queued_streams_with_shutdown_and_exits_0(
    tmp_path: Path, sig: signal.Signals
) -> None:
    flags = ("--slots", "2", "--shutdown-grace", str(GRACE_S))
    with running_server(tmp_path, *flags) as server:
        running = [Reader(server.url), Reader(server.url)]
        for reader in running:
            assert reader.started.wait(NET_S), (reader.error, server.text())
        queued = Reader(server.url)
        deadline = time.monotonic() + NET_S
        while _queued(server.url) < 1:
            assert time.monotonic() < deadline, "the third request was never queued"
            time.sleep(0.02)

        signalled = time.monotonic()
        server.process.send_signal(sig)
        status = server.process.wait(GRACE_S + NET_S)
        took = time.monotonic() - signalled

        assert status == 0, server.text()
        assert took < GRACE_S, server.text()
        for reader in [*running, queued]:
            reader.thread.join(NET_S)
            assert reader.error is None, reader.error
            assert reader.status == 200
            assert reader.events[-1] == "[DONE]"
            final = reader.events[-2]
            assert final["tokenbelt"]["end_reason"] == "shutdown"
            assert final["choices"][0]["finish_reason"] is not None
            assert final["tokenbelt"]["trace"]["timeline_ms"]["released"] is not None
        assert len(running[0].events) > 2  # content came before the final chunk
        assert queued.events[-2]["tokenbelt"]["trace"]["timeline_ms"]["admitted"] is None
        log = server.text()
        assert "Traceback" not in log
        assert "CancelledError" not in log
        assert f"shutdown ({sig.name}): refusing new requests; ending 2 running and 1 queued" in (
            log
        )
        assert "shutdown: every request released in" in log
        assert "shutdown: stopped" in log


@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_exits_at_once(tmp_path: Path, sig: signal.Signals) -> None:
    with running_server(tmp_path, "--shutdown-grace", "120") as server:
        # A request whose body never finishes holds its connection: after the first
        # signal the server waits for it, up to the grace period.
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=NET_S) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            time.sleep(0.2)  # the request reaches the app (no event to wait on here)
            server.process.send_signal(sig)
            server.wait_for_line("shutdown: closing connections")
            assert server.process.poll() is None  # still waiting for that connection
            second = time.monotonic()
            server.process.send_signal(sig)
            status = server.process.wait(NET_S)
            assert time.monotonic() - second < 10.0
        assert status == 128 + sig, server.text()
        log = server.text()
        assert f"tokenbelt: {sig.name} again: exiting now" in log
        assert "Traceback" not in log
