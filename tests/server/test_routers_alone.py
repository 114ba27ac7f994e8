"""Each dialect is a module-level router over the serving core: mounted alone on a bare
app that holds a ``RequestPath``, it answers as it does inside ``create_app``."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from starlette.testclient import TestClient

from tokenbelt import ScriptedEngine
from tokenbelt.server import ServerSettings, anthropic, ollama, openai, responses
from tokenbelt.server.core import RequestPath, ServerState

from .conftest import CHAT, chat_body, scripted_runtime


def _bare(*routers: APIRouter) -> tuple[FastAPI, ServerState]:
    runtime = scripted_runtime(ScriptedEngine([" a", " b"], delay=0))
    state = ServerState(runtime, ServerSettings())
    app = FastAPI()
    app.state.tokenbelt_path = RequestPath(state)
    for router in routers:
        app.include_router(router)
    return app, state


def test_each_dialect_answers_mounted_alone() -> None:
    app, state = _bare(openai.router, ollama.router, anthropic.router)
    try:
        with TestClient(app) as client:
            reply = client.post(CHAT, json=chat_body()).json()
            assert reply["choices"][0]["message"]["content"] == " a b"
            body = {"model": "scripted", "prompt": "hi", "stream": False}
            assert client.post("/api/generate", json=body).json()["response"] == " a b"
            body = {
                "model": "scripted",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
            }
            message = client.post(anthropic.PREFIX, json=body).json()
            assert message["content"] == [{"type": "text", "text": " a b"}]
    finally:
        state.runtime.close()


def test_the_openai_dialect_alone_has_no_other_routes() -> None:
    app, state = _bare(openai.router)
    try:
        with TestClient(app) as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == "scripted"
            assert client.post("/api/generate", json={"prompt": "hi"}).status_code == 404
            assert client.get("/health").status_code == 404
    finally:
        state.runtime.close()


def test_the_responses_dialect_alone_needs_only_its_memory() -> None:
    app, state = _bare(responses.router)
    app.state.tokenbelt_responses = responses.Responses(responses.Store(0, 60))
    try:
        with TestClient(app) as client:
            reply = client.post("/v1/responses", json={"input": "hi"}).json()
            assert reply["output"][0]["content"][0]["text"] == " a b"
            assert client.post(CHAT, json=chat_body()).status_code == 404
    finally:
        state.runtime.close()
