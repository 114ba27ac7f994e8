"""The Hugging Face source against a local stand-in for the Hub's ``resolve`` endpoint.

``huggingface_hub`` sends ``HEAD {HF_ENDPOINT}/{repo}/resolve/{revision}/{file}`` and
needs ``X-Repo-Commit`` and ``ETag`` (the sha256 of an LFS file) back, then ``GET``s
the same URL, with ``Range`` when it resumes its ``.incomplete`` file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tokenbelt import DownloadCancelled, DownloadError
from tokenbelt.models import Home, ModelCache, resolve_and_fetch

from .conftest import CPU_ONLY, catalog_of, files_under, payload, write_user_catalog
from .fileserver import FileServer, Served

COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILE_URL = "/org/tiny-GGUF/resolve/main/tiny.gguf"


def hub_file(server: FileServer) -> Served:
    served = Served(payload())
    served.headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{served.sha256}"'}
    server.files[FILE_URL] = served
    return served


def hf_entry(served: Served, file: str = "tiny.gguf") -> dict[str, Any]:
    return {
        "alias": "hf-tiny",
        "family": "test",
        "license": "MIT",
        "context_length": 2048,
        "variants": [
            {
                "id": "hf-tiny-q8-cpu",
                "device": "cpu",
                "size": len(served.data),
                "sha256": served.sha256,
                "source": {"type": "huggingface", "repo": "org/tiny-GGUF", "file": file},
            }
        ],
    }


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: FileServer) -> Path:
    """Point ``huggingface_hub`` at the stand-in and a temporary cache (in this process).

    The library reads ``HF_HOME`` once at import, so the cache folder is patched on its
    constants module; ``HF_ENDPOINT`` is read by tokenbelt at each download.
    """
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", server.url(""))
    return cache


def test_pull_resolves_into_the_hugging_face_cache(
    server: FileServer, home: Home, hf_cache: Path
) -> None:
    served = hub_file(server)
    catalog = catalog_of(hf_entry(served))
    resolved = resolve_and_fetch("hf-tiny", catalog=catalog, info=CPU_ONLY)
    assert resolved.path == hf_cache / "models--org--tiny-GGUF" / "snapshots" / COMMIT / "tiny.gguf"
    assert resolved.path.read_bytes() == served.data
    assert resolved.hashed
    assert [(h.method, h.path) for h in server.hits] == [("HEAD", FILE_URL), ("GET", FILE_URL)]
    variant = catalog.get("hf-tiny").variants[0]
    cache = ModelCache(home)
    assert cache.state(variant) == "verified"
    removed = cache.remove(variant)
    assert resolved.path in removed
    assert not resolved.path.exists()
    assert cache.state(variant) == "absent"


def test_cancel_stops_the_hub_download_and_the_next_pull_completes(
    server: FileServer, home: Home, hf_cache: Path
) -> None:
    served = hub_file(server)
    catalog = catalog_of(hf_entry(served))
    cancel = threading.Event()

    def progress(received: int, total: int | None) -> None:
        assert total == len(served.data)
        if received >= 100_000:
            cancel.set()

    with pytest.raises(DownloadCancelled, match="pull again"):
        resolve_and_fetch(
            "hf-tiny", catalog=catalog, info=CPU_ONLY, progress=progress, cancel=cancel
        )
    snapshot = hf_cache / "models--org--tiny-GGUF" / "snapshots" / COMMIT / "tiny.gguf"
    assert not snapshot.exists(), "a cancelled download never becomes the cached file"
    # Whether the library keeps a partial to resume is its own policy (the installed
    # release deletes it); either way the next pull completes and is verified.
    resolved = resolve_and_fetch("hf-tiny", catalog=catalog, info=CPU_ONLY)
    assert resolved.path == snapshot
    assert resolved.path.read_bytes() == served.data
    assert resolved.hashed


def test_missing_hub_file_is_a_clear_error(server: FileServer, home: Home, hf_cache: Path) -> None:
    served = hub_file(server)
    with pytest.raises(DownloadError, match=r"hf://org/tiny-GGUF/other.gguf@main"):
        resolve_and_fetch(
            "hf-tiny", catalog=catalog_of(hf_entry(served, "other.gguf")), info=CPU_ONLY
        )


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenbelt", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_honours_hf_endpoint_hf_home_and_offline_mode(
    server: FileServer, home: Home, tmp_path: Path
) -> None:
    """Real environment variables, read by ``huggingface_hub`` at import in a fresh process."""
    served = hub_file(server)
    write_user_catalog(home, hf_entry(served))
    env = dict(
        os.environ,
        TOKENBELT_HOME=str(home.data_dir),
        HF_HOME=str(tmp_path / "hf-home"),
        HF_ENDPOINT=server.url(""),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    pulled = _cli(env, "models", "pull", "hf-tiny")
    assert pulled.returncode == 0, pulled.stderr
    expected = tmp_path / "hf-home/hub/models--org--tiny-GGUF/snapshots" / COMMIT / "tiny.gguf"
    assert f"hf-tiny-q8-cpu ready on cpu: {expected}" in pulled.stdout
    assert expected.read_bytes() == served.data
    hits = len(server.hits)

    offline = _cli(dict(env, HF_HUB_OFFLINE="1"), "models", "pull", "hf-tiny")
    assert offline.returncode == 0, offline.stderr
    assert len(server.hits) == hits, "offline mode makes no request"

    listed = _cli(env, "models", "list", "--json")
    rows = {r["variant"]: r for r in json.loads(listed.stdout)["models"]}
    assert rows["hf-tiny-q8-cpu"]["state"] == "verified"

    removed = _cli(env, "models", "rm", "hf-tiny")
    assert removed.returncode == 0
    assert "removed" in removed.stdout
    assert not expected.exists()
    gone = _cli(dict(env, HF_HUB_OFFLINE="1"), "models", "pull", "hf-tiny")
    assert gone.returncode == 1
    assert "is not in the Hugging Face cache" in gone.stderr
    assert "Traceback" not in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1
    assert files_under(home.cache_dir) == []  # the Hub's files live in its own cache only


def test_the_hubs_log_records_reach_the_applications_handlers_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """huggingface_hub gives its logger a bare StreamHandler of its own and lets records
    propagate: under ``tokenbelt serve`` each of its warnings (a retry while offline) was
    printed twice, once without time or level. After tokenbelt looks at the hub, its
    records go to the application's handlers only."""
    import logging

    import huggingface_hub.utils.logging as hub_logging

    from tokenbelt.models._hf import cached_path
    from tokenbelt.models._sources import HuggingFaceSource

    hub = logging.getLogger("huggingface_hub")
    hub.addHandler(logging.StreamHandler())  # as the library's import does, once
    assert cached_path(HuggingFaceSource("nobody/nothing", "none.gguf")) is None
    assert [h for h in hub.handlers if type(h) is logging.StreamHandler] == []
    with caplog.at_level("WARNING"):
        hub_logging.get_logger("huggingface_hub.utils._http").warning("retrying HEAD")
    assert [r.getMessage() for r in caplog.records].count("retrying HEAD") == 1
