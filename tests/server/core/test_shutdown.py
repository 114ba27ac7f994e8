"""The shutdown's phases over HTTP, on a real uvicorn (``GracefulServer``) in a thread.

Signals only reach the main thread, so this test starts the shutdown the way the
signal handler does (``begin_shutdown`` on the event loop); the real SIGTERM and
SIGINT are tested on a real ``tokenbelt serve`` process in ``tests/cli``. A step
that cannot see the cancel holds the release, so each phase can be looked at while
it lasts.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

import plainhttp
from tokenbelt import EndReason, GenerationRequest, ScriptedEngine
from tokenbelt.belt import Producer
from tokenbelt.server import create_app
from tokenbelt.server.core._shutdown import GracefulServer

from ..conftest import CHAT, NET, Recorder, chat_body, scripted_runtime


class Harness:
    def __init__(self, engine: ScriptedEngine, grace: float) -> None:
        self.runtime = scripted_runtime(engine)
        self.recorder = Recorder()
        app = create_app(self.runtime)
        self.runtime.subscribe(self.recorder)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, log_config=None, log_level="warning", lifespan="on")
        self.server = GracefulServer(config, app.state.tokenbelt, grace=grace)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        started = threading.Event()
        for _ in range(int(NET / 0.01)):
            if self.server.started:
                started.set()
                break
            self.thread.join(0.01)
        assert started.is_set(), "uvicorn did not start"
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def begin_shutdown(self) -> None:
        loop = self.server._loop
        assert loop is not None
        loop.call_soon_threadsafe(self.server.begin_shutdown, "test")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(NET)
        self.runtime.close()
        self.sock.close()


class HeldStep(ScriptedEngine):
    """Sends one piece, then runs one step that cannot see a cancel until ``done`` is set."""

    def __init__(self) -> None:
        super().__init__(["first"])
        self.inside = threading.Event()
        self.done = threading.Event()

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        producer.count_prompt(self.count_prompt_tokens(request))
        producer.put(" first")
        self.inside.set()
        self.done.wait(NET)
        producer.checkpoint()
        return EndReason.STOP


@pytest.fixture
def engine() -> Iterator[HeldStep]:
    held = HeldStep()
    yield held
    held.done.set()


@pytest.fixture
def harness(engine: HeldStep) -> Iterator[Harness]:
    h = Harness(engine, grace=NET)
    yield h
    h.close()


def test_shutdown_refuses_new_requests_ends_running_ones_and_exits(
    harness: Harness, engine: HeldStep
) -> None:
    answers: list[httpx.Response] = []

    def ask() -> None:
        answers.append(plainhttp.post(f"{harness.url}{CHAT}", json=chat_body(), timeout=NET))

    running = threading.Thread(target=ask)
    running.start()
    trace = harness.recorder.nth(0)
    assert engine.inside.wait(NET)  # in the step that holds the slot until ``done``
    harness.begin_shutdown()
    harness.recorder.wait(trace, "cancel_requested")
    assert trace.end_reason is EndReason.SHUTDOWN
    assert trace.released is None  # the drain waits for it

    refused = plainhttp.post(f"{harness.url}{CHAT}", json=chat_body(), timeout=NET)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "shutting_down"
    ready = plainhttp.get(f"{harness.url}/health/ready", timeout=NET)
    assert ready.status_code == 503
    assert ready.json()["status"] == "shutting_down"
    assert plainhttp.get(f"{harness.url}/health/live", timeout=NET).status_code == 200

    engine.done.set()
    running.join(NET)
    harness.thread.join(NET)
    assert not harness.thread.is_alive(), "the server did not exit after the drain"
    (answer,) = answers
    assert answer.status_code == 503
    body: dict[str, Any] = answer.json()
    assert body["error"]["code"] == "shutdown"
    assert body["tokenbelt"]["end_reason"] == "shutdown"
    assert body["tokenbelt"]["trace"]["timeline_ms"]["released"] is not None


def test_an_idle_server_exits_at_once(harness: Harness) -> None:
    harness.begin_shutdown()
    harness.thread.join(NET)
    assert not harness.thread.is_alive()


def test_a_streamed_response_gets_its_terminal_event_on_shutdown(
    harness: Harness, engine: HeldStep
) -> None:
    events: list[dict[str, Any]] = []

    def read() -> None:
        body = {"input": "hi", "stream": True}
        with plainhttp.stream("POST", f"{harness.url}/v1/responses", json=body, timeout=NET) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    reader = threading.Thread(target=read)
    reader.start()
    trace = harness.recorder.nth(0)
    assert engine.inside.wait(NET)
    harness.begin_shutdown()
    harness.recorder.wait(trace, "cancel_requested")
    engine.done.set()
    reader.join(NET)
    harness.thread.join(NET)
    terminal = [e for e in events if e["type"].startswith("response.") and "response" in e]
    assert events[-1]["type"] == "response.failed"
    assert [e["type"] for e in terminal].count("response.failed") == 1
    final = events[-1]["response"]
    assert final["error"]["code"] == "shutdown"
    assert final["tokenbelt"]["end_reason"] == "shutdown"
