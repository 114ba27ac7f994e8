"""Fixtures for the models layer: a private tokenbelt home and a real file server."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenbelt.models import Catalog, DeviceInfo, Home
from tokenbelt.models._catalog import parse_catalog_text

from .fileserver import FileServer, Served

#: a machine that can only run on the CPU, whatever this one can do
CPU_ONLY = DeviceInfo(("cpu",), False, ("CPU",), ("AVX2",), "test machine: cpu only")
#: a machine with a CUDA build of llama.cpp
CUDA = DeviceInfo(("cuda", "cpu"), True, ("CUDA", "CPU"), ("AVX2",), "test machine: cuda")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Home:
    """``TOKENBELT_HOME`` in a temporary folder: nothing touches the real home."""
    root = tmp_path / "tbhome"
    monkeypatch.setenv("TOKENBELT_HOME", str(root))
    return Home.from_env()


@pytest.fixture
def server() -> Iterator[FileServer]:
    with FileServer() as s:
        yield s


def payload(size: int = 512 * 1024, seed: int = 7) -> bytes:
    """Deterministic bytes that start like a GGUF file."""
    block = bytes((i * seed + i // 251) % 256 for i in range(4096))
    data = (b"GGUF" + block * (size // 4096 + 1))[:size]
    return data


def url_entry(alias: str, url: str, served: Served, **variant: Any) -> dict[str, Any]:
    v: dict[str, Any] = {
        "id": f"{alias}-q8-cpu",
        "device": "cpu",
        "quantization": "Q8_0",
        "size": len(served.data),
        "sha256": served.sha256,
        "source": {"type": "url", "url": url},
    }
    v.update(variant)
    return {
        "alias": alias,
        "family": "test",
        "license": "MIT",
        "context_length": 2048,
        "variants": [v],
    }


def catalog_of(*entries: dict[str, Any]) -> Catalog:
    return Catalog(parse_catalog_text(json.dumps({"models": list(entries)}), "test-catalog"))


def write_user_catalog(home: Home, *entries: dict[str, Any]) -> Path:
    home.data_dir.mkdir(parents=True, exist_ok=True)
    home.catalog_file.write_text(json.dumps({"version": 1, "models": list(entries)}))
    return home.catalog_file


def files_under(folder: Path) -> list[str]:
    return sorted(
        str(Path(dirpath, name).relative_to(folder))
        for dirpath, _dirs, names in os.walk(folder)
        for name in names
    )
