"""``tokenbelt models pull hf://ORG/REPO/FILE.gguf`` against a local stand-in for the Hub.

The stand-in answers ``HEAD .../resolve/REVISION/FILE`` the way the Hub does (size in
``Content-Length``, the LFS sha256 in ``ETag``, the commit in ``X-Repo-Commit``) and
serves the file at the commit's address, with ``Range`` for resuming.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenbelt import DownloadError, InvalidArgument
from tokenbelt.models import DEFAULT_ALIAS, Catalog, Home, ModelCache
from tokenbelt.models._download import partial_path
from tokenbelt.models._hub import default_alias, hub_uri, parse_hf_uri, quantization_from_name

from .fileserver import FileServer, Served

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
FILE = "Tiny-Model-Q8_0.gguf"
URI = f"hf://org/tiny-GGUF/{FILE}"


def gguf_bytes(tmp_path: Path, floats: int = 200_000) -> bytes:
    """A real GGUF file (metadata and one tensor), big enough to be cut in the middle."""
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "source.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny hub model")
    writer.add_file_type(7)  # Q8_0
    writer.add_context_length(2048)
    writer.add_tensor("weights", np.arange(floats, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def publish(
    server: FileServer, data: bytes, revision: str = "main", etag: str | None = None
) -> Served:
    """The file at its revision (HEAD answers) and at its commit (the download)."""
    served = Served(data)
    served.headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag or served.sha256}"'}
    server.files[f"/org/tiny-GGUF/resolve/{revision}/{FILE}"] = served
    server.files[f"/org/tiny-GGUF/resolve/{COMMIT}/{FILE}"] = served
    return served


def pull(
    home: Home, server: FileServer | str, tmp_path: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    env = dict(
        {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")},
        TOKENBELT_HOME=str(home.data_dir),
        HF_ENDPOINT=server if isinstance(server, str) else server.url(""),
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return subprocess.run(
        [sys.executable, "-m", "tokenbelt", "models", "pull", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_pull_resolves_downloads_verifies_and_adds_the_alias(
    server: FileServer, home: Home, tmp_path: Path
) -> None:
    served = publish(server, gguf_bytes(tmp_path))
    done = pull(home, server, tmp_path, URI)
    assert done.returncode == 0, done.stderr
    alias = "tiny-model-q8_0"
    assert done.stdout.startswith(f"added {alias} (llama, context 2048, Q8_0, ")
    assert f"from {URI} at commit {COMMIT[:12]}" in done.stdout
    assert [(h.method, h.path) for h in server.hits] == [
        ("HEAD", f"/org/tiny-GGUF/resolve/main/{FILE}"),
        ("GET", f"/org/tiny-GGUF/resolve/{COMMIT}/{FILE}"),
    ]
    entry = Catalog.load(home).get(alias)
    (variant,) = entry.variants
    assert variant.sha256 == served.sha256
    assert variant.size == len(served.data)
    assert variant.source.to_json() == {
        "type": "url",
        "url": server.url(f"/org/tiny-GGUF/resolve/{COMMIT}/{FILE}"),
    }
    cache = ModelCache(home)
    assert cache.state(variant) == "verified"
    assert cache.local_path(variant) is not None
    assert cache.local_path(variant).read_bytes() == served.data  # type: ignore[union-attr]


def test_an_interrupted_pull_resumes_where_it_stopped(
    server: FileServer, home: Home, tmp_path: Path
) -> None:
    served = publish(server, gguf_bytes(tmp_path))
    served.drop_at = len(served.data) // 2
    first = pull(home, server, tmp_path, URI, "--alias", "tiny")
    assert first.returncode == 1
    assert "pull again to resume" in one_error_line(first.stderr)
    kept = partial_path(home.models_dir / "tiny-hf.gguf")
    assert kept.stat().st_size == len(served.data) // 2
    assert "tiny" not in Catalog.load(home)  # only a verified file gets an alias

    second = pull(home, server, tmp_path, URI, "--alias", "tiny")
    assert second.returncode == 0, second.stderr
    ranges = [h.range for h in server.gets]
    assert ranges == [None, f"bytes={len(served.data) // 2}-"]
    assert "tiny" in Catalog.load(home)


def test_revision_and_alias(server: FileServer, home: Home, tmp_path: Path) -> None:
    publish(server, gguf_bytes(tmp_path, floats=1024), revision="v1.0")
    done = pull(home, server, tmp_path, URI, "--revision", "v1.0", "--alias", "mine")
    assert done.returncode == 0, done.stderr
    assert server.hits[0].path == f"/org/tiny-GGUF/resolve/v1.0/{FILE}"
    assert "mine" in Catalog.load(home)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["hf://org/file.gguf"], "expected hf://ORG/REPO/FILE.gguf"),
        (["hf://org/tiny-GGUF/model.bin"], "expected hf://ORG/REPO/FILE.gguf"),
        ([f"hf://org/tiny-GGUF/{FILE}", "--alias", "bad name"], "alias 'bad name' must be"),
        (["hf://org/tiny-GGUF/other.gguf"], "hf://org/tiny-GGUF/other.gguf@main"),
        ([URI, "--revision", "nope"], f"{URI}@nope"),
        ([URI, "--alias", DEFAULT_ALIAS], f"the alias {DEFAULT_ALIAS!r} is taken"),
        ([URI, "--alias", DEFAULT_ALIAS, "--replace"], "pass --force as well"),
        (["smollm2-135m", "--alias", "x"], "are for hf:// pulls"),
    ],
)
def test_bad_pulls_are_one_line_errors(
    server: FileServer, home: Home, tmp_path: Path, args: list[str], expected: str
) -> None:
    publish(server, gguf_bytes(tmp_path, floats=1024))
    done = pull(home, server, tmp_path, *args)
    assert done.returncode in (1, 2)
    assert expected in one_error_line(done.stderr)
    assert not home.models_dir.exists() or not list(home.models_dir.glob("*.gguf"))


def test_a_file_without_a_sha256_is_refused(server: FileServer, home: Home, tmp_path: Path) -> None:
    publish(server, gguf_bytes(tmp_path, floats=1024), etag="0123abcd")  # a git blob id
    done = pull(home, server, tmp_path, URI)
    assert done.returncode == 1
    assert "gives no sha256" in one_error_line(done.stderr)
    assert not server.gets


def test_a_file_that_differs_from_its_sha256_is_not_added(
    server: FileServer, home: Home, tmp_path: Path
) -> None:
    publish(server, gguf_bytes(tmp_path, floats=1024), etag="ab" * 32)
    done = pull(home, server, tmp_path, URI, "--alias", "tiny")
    assert done.returncode == 1
    assert "sha256" in one_error_line(done.stderr)
    assert "tiny" not in Catalog.load(home)


def test_names_from_the_uri() -> None:
    assert parse_hf_uri("hf://a/b/sub/dir/m.gguf") == ("a/b", "sub/dir/m.gguf")
    with pytest.raises(InvalidArgument):
        parse_hf_uri("https://huggingface.co/a/b/m.gguf")
    assert default_alias("SmolLM2-135M-Instruct-Q8_0.gguf") == "smollm2-135m-instruct-q8_0"
    assert default_alias("sub/My Model (v2).gguf") == "my-model-v2"
    assert quantization_from_name("x.Q4_K_M.gguf") == "Q4_K_M"
    assert quantization_from_name("x-iq2_xs.gguf") == "IQ2_XS"
    assert quantization_from_name("x-f16.gguf") == "F16"
    assert quantization_from_name("model.gguf") is None


def test_listing_shows_the_pulled_model(server: FileServer, home: Home, tmp_path: Path) -> None:
    publish(server, gguf_bytes(tmp_path, floats=1024))
    assert pull(home, server, tmp_path, URI, "--alias", "tiny").returncode == 0
    listed = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "models", "list", "--json"],
        env=dict(os.environ, TOKENBELT_HOME=str(home.data_dir)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = {r["alias"]: r for r in json.loads(listed.stdout)["models"]}
    assert rows["tiny"]["state"] == "verified"
    assert rows["tiny"]["quantization"] == "Q8_0"


def test_a_hub_whose_name_does_not_resolve_is_one_line_at_once(home: Home, tmp_path: Path) -> None:
    # huggingface_hub alone retries a connection error five times (~23 s) first.
    done = pull(home, "http://hub.invalid", tmp_path, URI)
    assert done.returncode != 0
    line = one_error_line(done.stderr)
    assert "the Hub at http://hub.invalid cannot be reached: hub.invalid does not resolve" in line
    assert "Retrying" not in done.stderr


def test_listing_a_repository_on_a_hub_that_does_not_resolve_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")
    with pytest.raises(DownloadError, match=r"hub\.invalid does not resolve"):
        hub_uri("hf.co/org/tiny-GGUF:Q8_0")  # Ollama's pull names a repository
