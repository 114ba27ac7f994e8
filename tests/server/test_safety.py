"""Safe defaults: loopback unless a key is given, Bearer auth on the API, no stray CORS."""

from __future__ import annotations

import httpx
import pytest

from tokenbelt import ScriptedEngine
from tokenbelt.cli import main
from tokenbelt.server import ServerSettings

from .conftest import CHAT, NET, ServeFactory, chat_body, scripted_runtime, words


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::"])
def test_serve_refuses_a_public_address_without_a_key(
    host: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TOKENBELT_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--host", host, "--port", "0"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("tokenbelt: error:")
    assert "--api-key" in lines[0]


def test_the_api_needs_the_bearer_key_and_health_stays_open(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)), ServerSettings(api_key="k"))
    url = served.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k"}):
        for response in (
            httpx.post(f"{url}{CHAT}", json=chat_body(), headers=headers, timeout=NET),
            httpx.get(f"{url}/v1/models", headers=headers, timeout=NET),
            httpx.get(f"{url}/v1/requests", headers=headers, timeout=NET),
            httpx.get(f"{url}/metrics", headers=headers, timeout=NET),
        ):
            assert response.status_code == 401, (headers, response.request.url)
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_api_key"
    assert served.recorder.events == [], "an unauthorised request never reaches the model"

    health = httpx.get(f"{url}/health", timeout=NET)
    assert health.status_code == 200
    assert health.json()["status"] == "ok"

    auth = {"Authorization": "Bearer k"}
    reply = httpx.post(f"{url}{CHAT}", json=chat_body(), headers=auth, timeout=NET)
    assert reply.status_code == 200
    assert httpx.get(f"{url}/metrics", headers=auth, timeout=NET).status_code == 200


def test_no_cors_headers_for_a_foreign_origin_by_default(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))
    origin = {"Origin": "http://evil.example"}
    simple = httpx.post(f"{served.url}{CHAT}", json=chat_body(), headers=origin, timeout=NET)
    assert simple.status_code == 200
    assert not any(h.startswith("access-control-") for h in simple.headers)
    preflight = httpx.options(
        f"{served.url}{CHAT}",
        headers={**origin, "Access-Control-Request-Method": "POST"},
        timeout=NET,
    )
    assert not any(h.startswith("access-control-") for h in preflight.headers)


def test_cors_only_for_configured_origins(serve: ServeFactory) -> None:
    allowed = "http://app.example"
    served = serve(
        scripted_runtime(ScriptedEngine(words(3), delay=0)),
        ServerSettings(cors_origins=(allowed,)),
    )
    url = f"{served.url}{CHAT}"
    ok = httpx.post(url, json=chat_body(), headers={"Origin": allowed}, timeout=NET)
    assert ok.headers["access-control-allow-origin"] == allowed
    assert "x-request-id" in ok.headers["access-control-expose-headers"]
    preflight = httpx.options(
        url,
        headers={
            "Origin": allowed,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=NET,
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == allowed

    foreign = httpx.post(url, json=chat_body(), headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in foreign.headers
