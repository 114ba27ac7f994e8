"""``tokenbelt models ...``: one-line errors, never a traceback; list, verify, rm, add."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenbelt.cli import main
from tokenbelt.models import DEFAULT_ALIAS, default_model_path

DEFAULT_VARIANT = "smollm2-135m-instruct-q4_1-cpu"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "tbhome"
    monkeypatch.setenv("TOKENBELT_HOME", str(root))
    return root


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tokenbelt: error: ")
    return lines[0]


def write_catalog(home: Path, text: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / "catalog.json").write_text(text)
    return home / "catalog.json"


def test_list_json_shows_the_default_model(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "list", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["devices"][-1] == "cpu"
    assert data["device_reason"]
    row, *others = data["models"]
    assert row["alias"] == DEFAULT_ALIAS
    assert [r["kind"] for r in (row, *others)] == ["chat", "embedding", "rerank"]
    assert row["variant"] == DEFAULT_VARIANT
    assert row["source"] == "distribution"
    assert row["state"] in ("unverified", "verified")


def test_list_table(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # a wide terminal: no cell is wrapped
    code, out, _ = run(capsys, "models", "list")
    assert code == 0
    assert DEFAULT_VARIANT in out
    assert "Q4_1" in out
    assert "93.8 MiB" in out
    assert "embedding" in out
    assert "rerank" in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"models": [', "catalog.json: not valid JSON (line 1 column 13: Expecting value)"),
        ('{"models": [{"alias": "x"}]}', 'catalog.json: models[0] (x): missing field "variants"'),
        (
            '{"models": [{"alias": "x", "family": "f", "license": "l", "context_length": "big",'
            ' "variants": [{"id": "x-cpu", "device": "cpu", "size": 1, "sha256": "'
            + "a" * 64
            + '", "source": {"type": "path", "path": "x.gguf"}}]}]}',
            "catalog.json: models[0] (x).context_length: expected an integer > 0, got 'big'",
        ),
    ],
)
@pytest.mark.parametrize("command", [["list"], ["pull", "x"], ["verify"], ["rm", "x"]])
def test_catalog_errors_are_one_line(
    home: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str, command: list[str]
) -> None:
    file = write_catalog(home, text)
    code, _, err = run(capsys, "models", *command)
    assert code == 1
    line = one_error_line(err)
    assert str(file) in line
    assert line.endswith(expected.split("catalog.json")[1])


def test_unknown_alias_suggests_close_matches(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "models", "pull", "smollm-135m")
    assert code == 1
    assert "unknown model 'smollm-135m'; did you mean 'smollm2-135m'" in one_error_line(err)


def test_pull_verify_and_rm_of_the_packaged_model(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "models", "pull", DEFAULT_ALIAS)
    assert code == 0
    assert out.startswith(f"{DEFAULT_VARIANT} ready on ")
    assert str(default_model_path()) in out
    code, out, _ = run(capsys, "models", "verify", DEFAULT_ALIAS)
    assert code == 0
    assert out.startswith(f"ok        {DEFAULT_VARIANT}")
    code, out, _ = run(capsys, "models", "rm", DEFAULT_ALIAS)
    assert code == 0
    assert "nothing to remove" in out
    assert default_model_path().exists(), "a packaged file is never deleted"


def tiny_gguf(path: Path) -> Path:
    """A small real GGUF file: metadata and one tensor, written with ``gguf``."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_file_type(7)  # Q8_0
    writer.add_context_length(2048)
    writer.add_tensor("weights", np.arange(16384, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_add_list_verify_forget(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tiny_gguf(tmp_path / "mine.gguf")
    code, out, _ = run(capsys, "models", "add", str(copy), "--alias", "mine")
    assert code == 0
    assert out.strip() == "added mine (llama, context 2048, Q8_0, 64.2 KiB) as mine-local"
    code, out, _ = run(capsys, "models", "list", "--json")
    rows = {r["alias"]: r for r in json.loads(out)["models"]}
    assert rows["mine"]["source"] == "path"
    assert rows["mine"]["state"] == "verified"

    code, _, err = run(capsys, "models", "add", str(copy), "--alias", "mine")
    assert code == 1
    assert "the alias 'mine' is taken" in one_error_line(err)

    with copy.open("r+b") as f:  # damage the tensor data; the header stays intact
        f.seek(copy.stat().st_size - 4096)
        f.write(b"\xff" * 16)
    code, out, err = run(capsys, "models", "verify")
    assert code == 1
    assert f"ok        {DEFAULT_VARIANT}" in out
    assert "CORRUPT   mine-local" in out
    assert "sha256" in out
    assert "1 of 2 model files failed verification" in err

    code, out, _ = run(capsys, "models", "rm", "mine", "--forget")
    assert code == 0
    assert "forgot mine" in out
    assert copy.exists()
    code, out, _ = run(capsys, "models", "list", "--json")
    assert "mine" not in [r["alias"] for r in json.loads(out)["models"]]


def test_add_rejects_a_file_that_is_not_gguf(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("hello")
    code, _, err = run(capsys, "models", "add", str(bogus), "--alias", "notes")
    assert code == 1
    assert one_error_line(err).endswith("is not a GGUF model file (it does not start with 'GGUF')")


def test_usage_errors_exit_2(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "models")[0] == 2
    assert run(capsys, "models", "add", "x.gguf")[0] == 2  # --alias is required
    code, _, err = run(capsys, "models", "pull", "x", "--device", "tpu")
    assert code == 2
    assert "invalid choice: 'tpu'" in err
