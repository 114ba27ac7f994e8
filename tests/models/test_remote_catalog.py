"""Catalog entries of kind ``remote``: written, read, validated, and kept apart from files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenbelt import CatalogError, InvalidArgument, Runtime
from tokenbelt.models import Catalog, Home, RemoteEntry, add_remote, find_remote, remote_entries


def entry(**kw: object) -> RemoteEntry:
    base: dict[str, object] = {"alias": "far", "urls": ("http://h:8000",), "model": "m"}
    base.update(kw)
    return RemoteEntry(**base)  # type: ignore[arg-type]


def test_add_and_read_back(tokenbelt_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    add_remote(entry(api_key_env="FAR_KEY", headers={"x-team": "a"}))
    found = find_remote("far")
    assert found is not None
    assert found.urls == ("http://h:8000",)
    assert found.headers == {"x-team": "a"}
    # The key is read from the environment when used, never stored.
    assert "FAR_KEY" in Home.from_env().catalog_file.read_text()
    with pytest.raises(InvalidArgument, match="FAR_KEY"):
        found.upstreams()
    monkeypatch.setenv("FAR_KEY", "secret")
    (up,) = found.upstreams()
    assert up.api_key == "secret"
    assert "secret" not in Home.from_env().catalog_file.read_text()
    # The file catalog still reads: remote entries are not files.
    assert "far" not in Catalog.load()
    with pytest.raises(CatalogError, match="already in the catalog"):
        add_remote(entry(model="other"))
    add_remote(entry(model="other"), replace=True)
    assert remote_entries()["far"].model == "other"


def test_a_bad_entry_names_its_field(tokenbelt_home: Path) -> None:
    path = Home.from_env().catalog_file
    path.parent.mkdir(parents=True, exist_ok=True)
    bad = {"alias": "far", "kind": "remote", "url": ["ftp://h"], "model": "m"}
    path.write_text(json.dumps({"version": 1, "models": [bad]}))
    with pytest.raises(CatalogError, match="url") as info:
        remote_entries()
    assert str(path) in str(info.value)


def test_an_alias_of_a_shipped_model_is_taken(tokenbelt_home: Path) -> None:
    shipped = next(iter(Catalog.load())).alias
    with pytest.raises(CatalogError, match="already in the catalog"):
        add_remote(entry(alias=shipped))


def test_load_of_a_remote_entry_registers_a_remote_model(tokenbelt_home: Path) -> None:
    add_remote(entry())
    with Runtime(keep_alive=None) as rt:
        model = rt.load("far", health_interval=None)
        assert model.info["remote"] is True
        assert model.info["upstreams"] == ["http://h:8000"]


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["models", "add-remote", "x", "--url", "ftp://h", "--model", "m"], "http://"),
        (["models", "add-remote", "x", "--url", "http://h", "--model", "m", "--header", "nocolon"],
         "NAME:VALUE"),
        (["serve", "--upstream", "http://127.0.0.1:9"], "cannot list the models"),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_line(args: list[str], problem: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tokenbelt", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert problem in done.stderr, done.stderr
    assert len(lines) == 1 or lines[0].startswith("usage:"), done.stderr
