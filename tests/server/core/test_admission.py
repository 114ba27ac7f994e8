"""Admission: a full queue answers 429, a loading model 503; both say when to retry."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import httpx

import plainhttp
from tokenbelt import EndReason, Runtime, ScriptedEngine
from tokenbelt.engines import Engine
from tokenbelt.runtime import Model
from tokenbelt.server import ServerSettings

from ..conftest import CHAT, NET, RawClient, ServeFactory, chat_body, eventually, words


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


def test_a_full_queue_answers_429_with_retry_after(serve: ServeFactory) -> None:
    gate = threading.Event()
    runtime = Runtime(keep_alive=None, slots=1, queue_size=1)
    runtime.add_engines("scripted", [ScriptedEngine(words(3), delay=0, gate=gate)])
    served = serve(runtime, ServerSettings(retry_after_s=3))
    try:
        with RawClient(served.url) as running, RawClient(served.url) as waiting:
            running.send(CHAT, chat_body(stream=True))
            served.recorder.wait(served.recorder.nth(0), "admitted")
            waiting.send(CHAT, chat_body(stream=True))
            served.recorder.nth(1)
            served.wait_queued(1)

            response = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(), timeout=NET)
            error = assert_error(response, 429, "queue_full")
            assert error["type"] == "rate_limit_error"
            assert response.headers["retry-after"] == "3"
            rejected = served.recorder.nth(2)
            served.recorder.wait(rejected, "released")
            assert rejected.end_reason is EndReason.REJECTED
            assert rejected.admitted is None

            gate.set()  # the slot frees up: both accepted requests finish normally
            for client in (running, waiting):
                client.read_head()
                client.read_until(b"data: [DONE]")
    finally:
        gate.set()
    reply = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(), timeout=NET)
    assert reply.status_code == 200
    reasons = [served.recorder.nth(i).end_reason for i in range(4)]
    assert reasons == [EndReason.STOP, EndReason.STOP, EndReason.REJECTED, EndReason.STOP]


class SlowLoadingRuntime(Runtime):
    """Loads any alias as a scripted model whose engines take until ``gate`` is set."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(keep_alive=None)
        self.gate = gate
        self.loading = threading.Event()

    def load(self, alias: str = "slow", **options: Any) -> Model:
        def engines() -> Sequence[Engine]:
            self.loading.set()
            assert self.gate.wait(NET)
            return [ScriptedEngine(words(3), delay=0)]

        return self.add_engines(alias, engines)


def test_a_model_still_loading_answers_503_with_retry_after(serve: ServeFactory) -> None:
    gate = threading.Event()
    runtime = SlowLoadingRuntime(gate)
    served = serve(runtime, load="slow")
    try:
        assert runtime.loading.wait(NET)
        for body in (chat_body(model="slow"), chat_body()):
            response = plainhttp.post(f"{served.url}{CHAT}", json=body, timeout=NET)
            error = assert_error(response, 503, "model_loading")
            assert "slow" in error["message"]
            assert response.headers["retry-after"] == "1"

        health = plainhttp.get(f"{served.url}/health", timeout=NET).json()
        assert health["status"] == "loading"
        assert health["loads"]["slow"]["state"] == "loading"
        models = plainhttp.get(f"{served.url}/v1/models", timeout=NET).json()["data"]
        served_models = [m for m in models if m["tokenbelt"]["state"] != "available"]
        assert [(m["id"], m["tokenbelt"]["state"]) for m in served_models] == [("slow", "loading")]
    finally:
        gate.set()

    def ready() -> bool:
        return bool(plainhttp.get(f"{served.url}/health", timeout=NET).json()["status"] == "ok")

    eventually(ready)
    response = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(model="slow"), timeout=NET)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "".join(words(3))
