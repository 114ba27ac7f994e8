"""``models list`` at 80 columns, states from the last verification, hints, shipped aliases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenbelt.models import DEFAULT_ALIAS

from .test_models_cli import one_error_line, run, tiny_gguf

LONG_ALIAS = "a-rather-long-alias-for-my-own-finetune-v2"


@pytest.fixture
def home(tokenbelt_home: Path) -> Path:
    """The test's own tokenbelt home (``TOKENBELT_HOME``, set for every test)."""
    return tokenbelt_home


def listing(columns: int) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "models", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": str(columns)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_list_never_cuts_the_alias(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], columns: int
) -> None:
    file = tiny_gguf(tmp_path / "mine.gguf")
    assert run(capsys, "models", "add", str(file), "--alias", LONG_ALIAS)[0] == 0
    out = listing(columns)
    assert LONG_ALIAS in out
    assert DEFAULT_ALIAS in out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= columns


def test_list_says_corrupt_after_a_failed_verify_until_the_file_changes(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tiny_gguf(tmp_path / "mine.gguf")
    run(capsys, "models", "add", str(file), "--alias", "mine")
    with file.open("r+b") as f:
        f.seek(file.stat().st_size - 4096)
        f.write(b"\xff" * 16)

    def state() -> str:
        code, out, _ = run(capsys, "models", "list", "--json")
        assert code == 0
        rows = {r["alias"]: r for r in json.loads(out)["models"]}
        return str(rows["mine"]["state"])

    assert state() == "unverified"  # changed since its stamp, not checked yet
    code, out, _ = run(capsys, "models", "verify", "mine")
    assert code == 1
    assert "CORRUPT" in out
    assert state() == "corrupt"
    code, out, _ = run(capsys, "models", "list")
    assert "corrupt" in out
    file.write_bytes(tiny_gguf(tmp_path / "fresh.gguf").read_bytes())  # the right bytes again
    assert state() == "unverified"
    assert run(capsys, "models", "verify", "mine")[0] == 0
    assert state() == "verified"


def test_rm_of_an_added_alias_points_to_forget(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tiny_gguf(tmp_path / "mine.gguf")
    run(capsys, "models", "add", str(file), "--alias", "mine")
    code, out, _ = run(capsys, "models", "rm", "mine")
    assert code == 0
    assert "nothing to remove for mine" in out
    assert str(file) in out
    assert "tokenbelt models rm --forget mine" in out
    assert file.exists()


def test_rm_of_the_shipped_model_says_where_its_file_lives(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "models", "rm", DEFAULT_ALIAS)
    assert code == 0
    assert "inside an installed package" in out


def test_replacing_a_shipped_alias_needs_force(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tiny_gguf(tmp_path / "mine.gguf")
    code, _, err = run(capsys, "models", "add", str(file), "--alias", DEFAULT_ALIAS, "--replace")
    assert code == 1
    line = one_error_line(err)
    assert f"{DEFAULT_ALIAS!r} comes with tokenbelt" in line
    assert "--force" in line

    code, _, _ = run(
        capsys, "models", "add", str(file), "--alias", DEFAULT_ALIAS, "--replace", "--force"
    )
    assert code == 0
    code, out, _ = run(capsys, "models", "list", "--json")
    (row,) = [r for r in json.loads(out)["models"] if r["alias"] == DEFAULT_ALIAS]
    assert row["source"] == "path"

    code, out, _ = run(capsys, "models", "rm", DEFAULT_ALIAS, "--forget")
    assert code == 0
    assert "comes with tokenbelt again" in out
    code, out, _ = run(capsys, "models", "list", "--json")
    (row,) = [r for r in json.loads(out)["models"] if r["alias"] == DEFAULT_ALIAS]
    assert row["source"] == "distribution"


def test_replacing_an_added_alias_needs_only_replace(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tiny_gguf(tmp_path / "mine.gguf")
    assert run(capsys, "models", "add", str(file), "--alias", "mine")[0] == 0
    assert run(capsys, "models", "add", str(file), "--alias", "mine", "--replace")[0] == 0
