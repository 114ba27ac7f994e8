"""``tokenbelt probe``: the whole lifecycle on the real default model, and failing steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenbelt.cli import main

KEYS = {
    "device",
    "device_reason",
    "variant",
    "model_path",
    "verified",
    "load_s",
    "ttft_ms",
    "decode_tok_s",
    "cancel_release_prefill_ms",
    "cancel_release_decode_ms",
    "unload_rss_returned_mb",
    "ok",
}
#: RSS the process may keep after unloading (allocator caches, thread pools)
RSS_TOLERANCE_MB = 64.0


def assert_drafting_reported(report: dict[str, Any]) -> None:
    """The copying reply drafted by itself (no setting), and the report says whether that
    pays here from the rates it measured, with the row costs the engine measured."""
    assert report["draft_off_tok_s"] > 0
    assert report["draft_tok_s"] > 0
    assert report["draft_decision"] == "on"
    speedup = report["draft_tok_s"] / report["draft_off_tok_s"]
    assert report["draft_speedup"] == pytest.approx(speedup, abs=0.02)
    assert report["draft_pays"] is (report["draft_speedup"] >= 1.05)
    costs = report["draft_row_costs"]
    assert costs, report
    assert all(int(n) > 1 and cost > 0 for n, cost in costs.items()), costs


@pytest.mark.model
def test_probe_json_on_the_default_model(tmp_path: Path) -> None:
    """In a fresh process, so the RSS figures are the model's and no other test's."""
    env = dict(os.environ, TOKENBELT_HOME=str(tmp_path / "tbhome"))
    done = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "probe", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) >= KEYS
    assert report["ok"] is True
    assert report["failed_step"] is None
    assert report["variant"] == "smollm2-135m-instruct-q4_1-cpu"
    assert report["device"] in ("cpu", "cuda", "metal", "vulkan")
    assert report["device_reason"]
    assert Path(report["model_path"]).is_file()
    assert report["verified"] is True
    assert report["load_s"] > 0
    assert report["ttft_ms"] > 0
    assert report["decode_tok_s"] > 0
    assert report["reply"]
    assert_drafting_reported(report)
    # the prefill cancel landed inside a ~2000-token prefill and released promptly
    assert report["prefill_prompt_tokens"] >= 2000
    assert report["cancel_prefill_landed"] == "prefill"
    for key in ("cancel_release_prefill_ms", "cancel_release_decode_ms"):
        assert 0 <= report[key] < 1000, key  # the trace's release-lag alert threshold
    # unload gives the memory back: most of what loading took, within a tolerance
    grown = report["rss_loaded_mb"] - report["rss_before_load_mb"]
    assert grown > 0
    assert report["unload_rss_returned_mb"] >= 0.5 * grown
    assert report["unload_rss_residual_mb"] < RSS_TOLERANCE_MB


@pytest.mark.model
def test_probe_in_a_worker_process_reports_the_worker_memory_returned(tmp_path: Path) -> None:
    env = dict(os.environ, TOKENBELT_HOME=str(tmp_path / "tbhome"))
    done = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "probe", "--isolation", "process", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert report["isolation"] == "process"
    assert report["reply"]
    assert_drafting_reported(report)
    assert report["cancel_prefill_landed"] == "prefill"
    for key in ("cancel_release_prefill_ms", "cancel_release_decode_ms"):
        assert 0 <= report[key] < 1000, key
    # The weights lived in the worker, and unloading ended it: all of its memory is back.
    assert report["worker_rss_loaded_mb"] > 50
    assert report["worker_rss_after_unload_mb"] == 0.0
    assert report["rss_loaded_mb"] - report["rss_before_load_mb"] < report["worker_rss_loaded_mb"]


def test_probe_of_an_unknown_alias_fails_at_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENBELT_HOME", str(tmp_path / "tbhome"))
    assert main(["probe", "smollm2-13m", "--json"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["ok"] is False
    assert report["failed_step"] == "resolve"
    assert report["load_s"] is None
    assert err.startswith("tokenbelt: error: probe failed at step 'resolve': unknown model")
    assert "what to do: see the known aliases with `tokenbelt models list`" in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_probe_report_names_the_failed_step_without_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENBELT_HOME", str(tmp_path / "tbhome"))
    assert main(["probe", "nope"]) == 1
    out, err = capsys.readouterr()
    assert "failed at resolve" in out
    assert "probe failed at step 'resolve'" in err


@pytest.mark.model
@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["table", "json"])
def test_a_load_timeout_is_printed_not_swallowed(tmp_path: Path, json_flag: list[str]) -> None:
    # The load is abandoned at its deadline and goes on in the background; loading used
    # to point the process's stdout and stderr at /dev/null meanwhile, so the report and
    # the error line were lost and the probe exited 1 in silence.
    env = dict(os.environ, TOKENBELT_HOME=str(tmp_path / "tbhome"), COLUMNS="100")
    done = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "probe", "--load-timeout", "0.001", *json_flag],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("tokenbelt: error: probe failed at step 'load': loading ")
    assert "took longer than 0.001 s" in line
    assert "raise --load-timeout" in line
    if json_flag:
        report = json.loads(done.stdout)
        assert report["failed_step"] == "load"
        assert report["ok"] is False
    else:
        assert "failed at load" in done.stdout


def test_an_unexpected_failure_is_printed_as_the_failed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenbelt.models import _probe

    def unreadable() -> None:
        raise PermissionError("/sys/devices: permission denied")

    monkeypatch.setenv("TOKENBELT_HOME", str(tmp_path / "tbhome"))
    monkeypatch.setattr(_probe, "detect_device", unreadable)
    assert main(["probe", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["failed_step"] == "resolve"
    assert err.startswith(
        "tokenbelt: error: probe failed at step 'resolve': "
        "PermissionError: /sys/devices: permission denied"
    )
    assert len(err.strip().splitlines()) == 1
