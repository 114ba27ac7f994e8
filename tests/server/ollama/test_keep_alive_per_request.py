"""A request's settings stay that request's: Ollama's ``keep_alive`` holds for the request
that gave it (``0`` unloads after it, and only after it), and the server-wide keep-alive
changes only through the admin path."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import httpx
import pytest

import plainhttp
from tokenbelt import EndReason, ModelState, Runtime, ScriptedEngine
from tokenbelt.server import ServerSettings

from ..conftest import CHAT, NET, Served, ServeFactory, chat_body

ADMIN, USER = "sk-admin", "sk-user"


def until(check: object, what: str) -> None:
    deadline = time.monotonic() + NET
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def made() -> list[ScriptedEngine]:
    return []


@pytest.fixture
def served(serve: ServeFactory, made: list[ScriptedEngine]) -> Served:
    def factory() -> list[ScriptedEngine]:
        made.append(ScriptedEngine(["hello"], delay=0))
        return made[-1:]

    runtime = Runtime(keep_alive=300.0)
    runtime.add_engines("scripted", factory)
    return serve(runtime, ServerSettings(api_keys=(USER,), admin_key=ADMIN))


def post(served: Served, path: str, body: object, key: str = USER) -> httpx.Response:
    auth = {"authorization": f"Bearer {key}"}
    return plainhttp.post(f"{served.url}{path}", json=body, headers=auth, timeout=NET)


def ollama(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": "scripted", "prompt": prompt, "stream": False, **extra}


def test_keep_alive_zero_unloads_after_that_request_only(
    served: Served, made: list[ScriptedEngine]
) -> None:
    model = served.model("scripted")
    assert post(served, "/api/generate", ollama("hi", keep_alive=0)).status_code == 200
    until(lambda: model.state is ModelState.IDLE_UNLOADED, "the unload after that request")

    # Another client, no keep_alive: it loads the model again, which then stays loaded
    # for the server's keep-alive; every later request pays no reload.
    for _ in range(3):
        answer = post(served, CHAT, chat_body())
        assert answer.status_code == 200
        trace = served.recorder.by_id(answer.headers["x-request-id"])
        served.assert_released(trace, EndReason.STOP)
        assert model.state is ModelState.READY
        assert model.idle_keep_alive == 300.0
    assert len(made) == 2
    assert model.keep_alive == 300.0


def test_a_request_keep_alive_shows_in_ps_until_the_next_request(served: Served) -> None:
    model = served.model("scripted")
    assert post(served, "/api/generate", ollama("hi", keep_alive="10m")).status_code == 200
    (running,) = plainhttp.get(
        f"{served.url}/api/ps", headers={"authorization": f"Bearer {USER}"}, timeout=NET
    ).json()["models"]
    left = datetime.fromisoformat(running["expires_at"]) - datetime.now(UTC)
    assert 500 < left.total_seconds() <= 600
    assert post(served, CHAT, chat_body()).status_code == 200
    assert model.idle_keep_alive == 300.0
    assert model.keep_alive == 300.0


def test_the_server_wide_keep_alive_changes_only_through_the_admin_path(served: Served) -> None:
    model = served.model("scripted")
    path = "/v1/admin/models/scripted/keep_alive"
    refused = post(served, path, {"keep_alive": 60})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "admin_only"
    assert model.keep_alive == 300.0

    done = post(served, path, {"keep_alive": 60}, key=ADMIN)
    assert done.status_code == 200, done.text
    assert done.json() == {"model": "scripted", "keep_alive": 60.0}
    assert post(served, CHAT, chat_body()).status_code == 200
    assert (model.keep_alive, model.idle_keep_alive) == (60.0, 60.0)
    assert post(served, path, {"keep_alive": -1}, key=ADMIN).status_code == 400
