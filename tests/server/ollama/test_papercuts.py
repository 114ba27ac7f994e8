"""What Ollama clients and operators ran into, one test each: a DELETE with a body, pulls by
Hub name and what a refused pull suggests, no server path in an answer unless the admin key
asked, ``parameter_size``, and a GGUF header read without its arrays (the first
``/api/tags`` used to decode the whole vocabulary)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gguf import GGUFReader

import plainhttp
from models.fileserver import FileServer
from models.fileserver import Served as File
from models.test_hub_pull import COMMIT, FILE, gguf_bytes, publish
from tokenbelt import Runtime
from tokenbelt.models import Catalog, Home, default_model_path, read_gguf_info
from tokenbelt.server import ServerSettings

from ..conftest import NET, Served, ServeFactory, real_runtime, scripted_runtime

ADMIN, USER = "sk-admin", "sk-user"


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def scripted(serve: ServeFactory) -> Served:
    from tokenbelt import ScriptedEngine

    return serve(scripted_runtime(ScriptedEngine(["hi"], delay=0)))


def test_delete_with_a_body_as_ollama_documents_it(scripted: Served) -> None:
    # curl -X DELETE http://localhost:11434/api/delete -d '{"model": "..."}'
    for name, status in (("no-such-model", 404), ("smollm2-135m", 200)):
        answer = plainhttp.request(
            "DELETE",
            f"{scripted.url}/api/delete",
            content=json.dumps({"model": name}).encode(),
            headers={"content-type": "application/x-www-form-urlencoded"},  # what curl -d says
            timeout=NET,
        )
        assert answer.status_code == status, answer.text
    assert (
        "no-such-model"
        in plainhttp.request(
            "DELETE",
            f"{scripted.url}/api/delete",
            content=b'{"model": "no-such-model"}',
            timeout=NET,
        ).json()["error"]
    )


def test_a_refused_pull_suggests_only_names_a_client_can_use(scripted: Served) -> None:
    answer = plainhttp.post(
        f"{scripted.url}/api/pull",
        json={"model": "smollm2-135m-instruct:Q4_1", "stream": False},
        timeout=NET,
    )
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert "did you mean 'smollm2-135m'" in error
    # the variant id is an alias's file, not a model name /api/chat takes
    assert "q4_1-cpu" not in error


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FileServer]:
    """A local stand-in for the Hub: the repository's file list and one GGUF file."""
    with FileServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url(""))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        publish(server, gguf_bytes(tmp_path, floats=4096))
        listing = [
            {"type": "file", "path": name, "oid": "0" * 40, "size": 1}
            for name in ("README.md", FILE, "Tiny-Model-Q4_K_M.gguf", "mmproj-Q8_0.gguf")
        ]
        server.files["/api/models/org/tiny-GGUF/tree/main"] = File(json.dumps(listing).encode())
        yield server


def pull_lines(served: Served, name: str) -> list[dict[str, object]]:
    with plainhttp.stream(
        "POST", f"{served.url}/api/pull", json={"model": name}, timeout=NET
    ) as answer:
        assert answer.status_code == 200
        return [json.loads(line) for line in answer.iter_lines() if line.strip()]


@pytest.mark.parametrize(
    "name", [f"hf://org/tiny-GGUF/{FILE}", "hf.co/org/tiny-GGUF:Q8_0", "hf.co/org/tiny-GGUF:q8_0"]
)
def test_pull_takes_hub_names(hub: FileServer, scripted: Served, name: str) -> None:
    lines = pull_lines(scripted, name)
    assert lines[-1] == {"status": "success", "tokenbelt": {"alias": "tiny-model-q8_0"}}, lines
    assert f"/org/tiny-GGUF/resolve/{COMMIT}/{FILE}" in [h.path for h in hub.gets]
    assert "tiny-model-q8_0" in Catalog.load(Home.from_env())


def test_a_hub_name_without_such_a_file_says_what_is_there(
    hub: FileServer, scripted: Served
) -> None:
    lines = pull_lines(scripted, "hf.co/org/tiny-GGUF:Q2_K")
    error = str(lines[-1]["error"])
    assert "has no Q2_K GGUF file" in error
    assert "Q4_K_M, Q8_0" in error  # the quantizations the repository has (not mmproj's)


@pytest.fixture
def real(serve: ServeFactory) -> Served:
    settings = ServerSettings(api_keys=(USER,), admin_key=ADMIN)
    return serve(real_runtime(), settings)


@pytest.mark.model
def test_no_server_path_in_an_answer_unless_the_admin_key_asked(real: Served) -> None:
    path = str(Path(default_model_path()).resolve().parent)
    name = real.model().name
    asks = [
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{name}", None),
        ("GET", "/health", None),
        ("POST", "/api/show", {"model": name}),
    ]
    for method, where, body in asks:
        user = plainhttp.request(
            method, real.url + where, json=body, headers=auth(USER), timeout=NET
        )
        assert user.status_code == 200, user.text
        assert path not in user.text, where
        admin = plainhttp.request(
            method, real.url + where, json=body, headers=auth(ADMIN), timeout=NET
        )
        assert admin.status_code == 200
        if where != "/health":
            assert path in admin.text, where
    shown = plainhttp.post(
        f"{real.url}/api/show", json={"model": name}, headers=auth(USER), timeout=NET
    ).json()
    assert shown["modelfile"] == f"FROM {Path(default_model_path()).name}\n"


@pytest.mark.model
def test_a_failed_load_names_its_file_not_where_it_is(serve: ServeFactory, tmp_path: Path) -> None:
    broken = tmp_path / "hidden-dir" / "broken.gguf"
    broken.parent.mkdir()
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    served = serve(Runtime(keep_alive=None), load=str(broken))
    for _ in range(200):
        health = plainhttp.get(f"{served.url}/health", timeout=NET)
        if health.json()["status"] == "failed":
            break
        time.sleep(0.05)
    text = health.text
    assert "broken.gguf" in text
    assert "hidden-dir" not in text


@pytest.mark.model
def test_show_gives_the_parameter_size_from_the_gguf(real: Served) -> None:
    shown = plainhttp.post(
        f"{real.url}/api/show", json={"model": real.model().name}, headers=auth(USER), timeout=NET
    ).json()
    reader = GGUFReader(str(default_model_path()), "r")
    count = sum(int(t.n_elements) for t in reader.tensors)
    assert shown["details"]["parameter_size"] == f"{count / 1e6:.2f}M"  # 134.52M, as Ollama
    tags = plainhttp.get(f"{real.url}/api/tags", headers=auth(USER), timeout=NET).json()
    assert tags["models"][0]["details"]["parameter_size"] == shown["details"]["parameter_size"]


def test_the_header_reader_agrees_with_the_gguf_package() -> None:
    """The fast reader (arrays stepped over) finds what ``GGUFReader`` decodes in full."""
    path = Path(default_model_path())
    info = read_gguf_info(path)
    reader = GGUFReader(str(path), "r")

    def text(key: str) -> str:
        field = reader.fields[key]
        return bytes(field.parts[field.data[0]]).decode()

    assert info.architecture == text("general.architecture")
    assert info.name == text("general.name")
    assert info.license == text("general.license")
    ctx = reader.fields["llama.context_length"]
    assert info.context_length == int(ctx.parts[ctx.data[0]][0])
    assert info.parameter_count == sum(int(t.n_elements) for t in reader.tensors)
