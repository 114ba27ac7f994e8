"""Safe defaults: loopback unless a key is given, Bearer auth on the API, no stray CORS,
only this server's own Host names, requests that belong to the key that made them, and no
answer that tells what is on disk."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import plainhttp
from tokenbelt import EndReason, InvalidArgument, ScriptedEngine
from tokenbelt.cli import main
from tokenbelt.cli._serve import allowed_hosts
from tokenbelt.server import ServerSettings

from ..conftest import (
    CHAT,
    NET,
    RawClient,
    ServeFactory,
    StallingEngine,
    chat_body,
    scripted_runtime,
    words,
)


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
            plainhttp.post(f"{url}{CHAT}", json=chat_body(), headers=headers, timeout=NET),
            plainhttp.get(f"{url}/v1/models", headers=headers, timeout=NET),
            plainhttp.get(f"{url}/v1/requests", headers=headers, timeout=NET),
            plainhttp.get(f"{url}/metrics", headers=headers, timeout=NET),
        ):
            assert response.status_code == 401, (headers, response.request.url)
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_api_key"
    assert served.recorder.events == [], "an unauthorised request never reaches the model"

    health = plainhttp.get(f"{url}/health", timeout=NET)
    assert health.status_code == 200
    assert health.json()["status"] == "ok"

    auth = {"Authorization": "Bearer k"}
    reply = plainhttp.post(f"{url}{CHAT}", json=chat_body(), headers=auth, timeout=NET)
    assert reply.status_code == 200
    assert plainhttp.get(f"{url}/metrics", headers=auth, timeout=NET).status_code == 200


def test_no_cors_headers_for_a_foreign_origin_by_default(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))
    origin = {"Origin": "http://evil.example"}
    simple = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(), headers=origin, timeout=NET)
    assert simple.status_code == 200
    assert not any(h.startswith("access-control-") for h in simple.headers)
    preflight = plainhttp.options(
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
    ok = plainhttp.post(url, json=chat_body(), headers={"Origin": allowed}, timeout=NET)
    assert ok.headers["access-control-allow-origin"] == allowed
    assert "x-request-id" in ok.headers["access-control-expose-headers"]
    preflight = plainhttp.options(
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

    foreign = plainhttp.post(url, json=chat_body(), headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in foreign.headers


# -- Host allow-list, API keys, model names ------------------------------------------------------


def test_a_rebinding_host_is_refused(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.:80"):
        with RawClient(served.url) as client:
            client.host = host  # the name the page's DNS pointed at this machine
            client.send(CHAT, chat_body())
            status, headers = client.read_head()
            body = json.loads(client.read_until(b"}}"))
        assert status == 421, host
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "host_not_allowed"
        assert headers["x-request-id"].startswith("req_")
    for path in ("/v1/requests", "/health", "/"):
        refused = plainhttp.get(served.url + path, headers={"Host": "evil.example"}, timeout=NET)
        assert refused.status_code == 421, path
    assert served.recorder.events == [], "a refused request never reaches the model"

    for host in ("localhost", f"localhost:{served.port}", "127.0.0.1", "[::1]:8080", "LOCALHOST"):
        ok = plainhttp.post(
            served.url + CHAT, json=chat_body(), headers={"Host": host}, timeout=NET
        )
        assert ok.status_code == 200, host


def test_allowed_hosts_are_configurable(serve: ServeFactory) -> None:
    served = serve(
        scripted_runtime(ScriptedEngine(words(3), delay=0)),
        ServerSettings(allowed_hosts=("llm.internal",)),
    )
    ok = plainhttp.get(f"{served.url}/v1/models", headers={"Host": "llm.internal:80"}, timeout=NET)
    assert ok.status_code == 200
    # Only the names given: loopback names too must be listed to be served.
    assert plainhttp.get(f"{served.url}/v1/models", timeout=NET).status_code == 421


def test_serve_allows_loopback_names_and_any_name_on_a_public_bind() -> None:
    assert allowed_hosts("127.0.0.1", []) == ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts("127.0.0.1", ["box.lan"])[-1] == "box.lan"
    assert "*" in allowed_hosts("0.0.0.0", [])


def test_the_bearer_scheme_is_case_insensitive(serve: ServeFactory) -> None:
    served = serve(
        scripted_runtime(ScriptedEngine(words(3), delay=0)), ServerSettings(api_key="k3y")
    )
    for value in ("bearer k3y", "BEARER k3y", "Bearer  k3y", "bEaReR k3y"):
        answer = plainhttp.get(
            f"{served.url}/v1/models", headers={"Authorization": value}, timeout=NET
        )
        assert answer.status_code == 200, value
    for value in ("bearer k3", "basic k3y", "k3y", "bearer", "bearerk3y"):
        answer = plainhttp.get(
            f"{served.url}/v1/models", headers={"Authorization": value}, timeout=NET
        )
        assert answer.status_code == 401, value


@pytest.mark.parametrize("key", [" ", "", "\t", " k3y"])
def test_serve_refuses_a_blank_api_key(
    key: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TOKENBELT_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--api-key", key, "--port", "0"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("tokenbelt: error:")
    assert "API key" in lines[0]


def test_a_blank_key_in_the_environment_is_refused_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENBELT_API_KEY", "  ")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "0"])
    assert exit_.value.code == 2
    assert "API key" in capsys.readouterr().err
    with pytest.raises(InvalidArgument):
        ServerSettings(api_key=" ")


def test_a_model_path_does_not_tell_whether_the_file_exists(
    serve: ServeFactory, tmp_path: Path
) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))
    real = tmp_path / "secret.gguf"
    real.write_bytes(b"GGUF")
    missing = tmp_path / "missing.gguf"

    def ask(path: Path) -> httpx.Response:
        return plainhttp.post(served.url + CHAT, json=chat_body(model=str(path)), timeout=NET)

    found, absent = ask(real), ask(missing)
    assert found.status_code == absent.status_code == 404
    # (An answer names a path by its last part only: the file's name.)
    shown = found.json()["error"]["message"].replace(real.name, "PATH")
    assert shown == absent.json()["error"]["message"].replace(missing.name, "PATH")
    assert str(tmp_path) not in shown
    assert found.json()["error"]["code"] == absent.json()["error"]["code"] == "model_not_found"


# -- requests belong to the key that made them ---------------------------------------------------


def test_a_client_cannot_read_or_cancel_another_clients_request(serve: ServeFactory) -> None:
    served = serve(
        scripted_runtime(StallingEngine([" a"]), StallingEngine([" a"]), slots=2),
        ServerSettings(api_key="alice-key", api_keys=("bob-key",), admin_key="root-key"),
    )
    url = served.url

    def as_(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    with RawClient(url) as alice:
        alice.send(CHAT, chat_body(stream=True), headers=as_("alice-key"))
        _, headers = alice.read_head()
        theirs = headers["x-request-id"]
        served.recorder.wait(served.recorder.by_id(theirs), "first_token")

        # Bob's own request, and what Bob sees of Alice's: nothing, as for an unknown id.
        bob = RawClient(url)
        bob.send(CHAT, chat_body(stream=True), headers=as_("bob-key"))
        mine = bob.read_head()[1]["x-request-id"]
        unknown = plainhttp.get(
            f"{url}/v1/requests/req_nobody", headers=as_("bob-key"), timeout=NET
        )
        for answer in (
            plainhttp.get(f"{url}/v1/requests/{theirs}", headers=as_("bob-key"), timeout=NET),
            plainhttp.post(
                f"{url}/v1/requests/{theirs}/cancel", headers=as_("bob-key"), timeout=NET
            ),
        ):
            assert answer.status_code == 404
            assert answer.json()["error"]["code"] == unknown.json()["error"]["code"]
        listed = plainhttp.get(f"{url}/v1/requests", headers=as_("bob-key"), timeout=NET).json()
        assert [r["request_id"] for r in listed["data"]] == [mine]
        assert served.recorder.by_id(theirs).end_reason is None, "Bob stopped nothing"

        # The admin key sees everyone's; Alice reads and cancels her own.
        every = plainhttp.get(f"{url}/v1/requests", headers=as_("root-key"), timeout=NET).json()
        assert {r["request_id"] for r in every["data"]} == {theirs, mine}
        own = plainhttp.get(f"{url}/v1/requests/{theirs}", headers=as_("alice-key"), timeout=NET)
        assert own.status_code == 200
        cancel = plainhttp.post(
            f"{url}/v1/requests/{theirs}/cancel", headers=as_("alice-key"), timeout=NET
        )
        assert cancel.json()["cancelled"] is True
        alice.read_until(b"data: [DONE]")
        bob.close()
    served.recorder.wait(served.recorder.by_id(theirs), "released")
    served.assert_released(served.recorder.by_id(mine), EndReason.CLIENT_DISCONNECT)
    served.assert_released(served.recorder.by_id(theirs), EndReason.USER_CANCEL)


def test_serve_takes_a_key_per_client_and_an_admin_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TOKENBELT_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--api-key", "a", "--api-key", "b", "--admin-key", " ", "--port", "0"])
    assert exit_.value.code == 2
    assert "API key" in capsys.readouterr().err
    assert ServerSettings(api_key="a", api_keys=("b",), admin_key="c").keys() == ("a", "b", "c")


def test_curl_d_and_a_body_without_content_type_are_json_but_not_from_a_browser(
    serve: ServeFactory,
) -> None:
    """``curl -d`` (form-urlencoded, as Ollama's examples send it) and clients that send
    no Content-Type get their JSON body read; the same bodies with a browser's ``Origin``
    (a page may send them to any site without a CORS preflight) stay refused, and
    nothing runs."""
    import shutil
    import subprocess

    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))
    body = json.dumps({**chat_body(), "model": served.model().name, "stream": False})
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    done = subprocess.run(
        ["curl", "-sS", "--max-time", str(int(NET)), "-d", body, f"{served.url}/api/chat"],
        capture_output=True,
        check=True,
        text=True,
        timeout=NET + 5,
    )
    assert json.loads(done.stdout)["message"]["content"].strip()

    for route in ("/api/chat", "/v1/chat/completions"):
        for content_type in (None, "text/plain;charset=UTF-8"):
            headers = {} if content_type is None else {"content-type": content_type}
            ok = plainhttp.post(served.url + route, content=body, headers=headers, timeout=NET)
            assert ok.status_code == 200, ok.text
    answered = len(served.recorder.events)

    for route in ("/api/chat", "/v1/chat/completions"):
        for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):
            headers = {"origin": "https://page.example"}
            if content_type is not None:
                headers["content-type"] = content_type
            refused = plainhttp.post(served.url + route, content=body, headers=headers, timeout=NET)
            assert refused.status_code == 400, refused.text
            assert "Content-Type: application/json" in refused.text
    assert len(served.recorder.events) == answered  # nothing more was queued


def test_with_api_keys_health_details_are_for_key_holders_only(serve: ServeFactory) -> None:
    """A probe without a key still gets the verdict (and the status code); what a
    stranger could use (worker pids, memory, crash and load errors) needs a key."""
    served = serve(scripted_runtime(StallingEngine([" a"])), ServerSettings(api_key="alice-key"))
    for path in ("/health", "/health/ready"):
        anonymous = plainhttp.get(f"{served.url}{path}", timeout=NET)
        assert anonymous.status_code == 200
        assert set(anonymous.json()) == {"status", "models", "details"}
        assert anonymous.json()["status"] == "ok"
        keyed = plainhttp.get(
            f"{served.url}{path}", headers={"Authorization": "Bearer alice-key"}, timeout=NET
        )
        assert keyed.status_code == 200
        assert {"status", "reason", "models", "loads"} <= set(keyed.json())
