"""``tokenbelt demo`` through the real command line, and ``run_demo`` through Python."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest

from tokenbelt import InvalidArgument
from tokenbelt.cli import main
from tokenbelt.cli._demo import DemoSummary, run_demo

SUMMARY_KEYS = {"produced", "consumed", "buffer_peak", "end_reason", "cancel_to_release_ms"}


def tokenbelt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenbelt", "demo", *args],
        capture_output=True,
        text=True,
        timeout=30,  # a net: one run takes well under a second
        check=False,
    )


def check_summary(summary: dict[str, Any], capacity: int, limit: int) -> None:
    assert set(summary) == SUMMARY_KEYS
    assert summary["consumed"] == limit
    assert summary["end_reason"] == "user_cancel"
    ctr = summary["cancel_to_release_ms"]
    assert isinstance(ctr, int | float)
    assert not isinstance(ctr, bool)
    assert ctr >= 0
    assert 1 <= summary["buffer_peak"] <= capacity
    assert 0 <= summary["produced"] - summary["consumed"] <= capacity


@pytest.mark.parametrize("limit", [3, 5])
@pytest.mark.parametrize("capacity", [1, 2, 20])
def test_demo_matrix_json(capacity: int, limit: int) -> None:
    done = tokenbelt("--capacity", str(capacity), "--limit", str(limit), "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert len(lines) == 1  # only the summary: no token lines with --json
    check_summary(json.loads(lines[0]), capacity, limit)


def test_demo_text_prints_one_line_per_token_then_the_summary() -> None:
    done = tokenbelt("--capacity", "2", "--limit", "4", "--produce-ms", "1", "--consume-ms", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    token_lines = lines[:4]
    for i, line in enumerate(token_lines):
        assert re.fullmatch(rf"\s*\d+\.\d ms  tok{i}\s+belt [0-2]/2", line), line
    assert lines[4] == ""
    summary = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[5:10])
    assert list(summary) == [
        "produced",
        "consumed",
        "buffer peak",
        "end reason",
        "cancel to release",
    ]
    assert summary["consumed"] == "4"
    assert summary["end reason"] == "user_cancel"
    assert re.fullmatch(r"\d+(\.\d+)? ms", summary["cancel to release"])
    assert int(summary["buffer peak"]) <= 2


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--capacity", "0"),
        ("--capacity", "-3"),
        ("--capacity", "two"),
        ("--produce-ms", "-1"),
        ("--produce-ms", "inf"),
        ("--consume-ms", "nan"),
        ("--limit", "-1"),
        ("--limit", "1.5"),
    ],
)
def test_demo_bad_flags_are_one_line_with_status_2(flag: str, value: str) -> None:
    done = tokenbelt(f"{flag}={value}")
    assert done.returncode == 2
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("tokenbelt demo: error: argument")
    assert flag in lines[0]


def test_demo_in_process_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--capacity", "1", "--limit", "2", "--consume-ms", "0", "--json"]) == 0
    check_summary(json.loads(capsys.readouterr().out), capacity=1, limit=2)


def test_run_demo_limit_zero_cancels_before_reading() -> None:
    summary = run_demo(capacity=2, limit=0, produce_ms=0, consume_ms=0, echo=False)
    assert isinstance(summary, DemoSummary)
    assert summary.consumed == 0
    assert summary.end_reason == "user_cancel"
    assert summary.cancel_to_release_ms is not None
    assert summary.produced <= 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0},
        {"capacity": True},
        {"limit": -1},
        {"limit": 2.0},
        {"produce_ms": -1},
        {"consume_ms": float("nan")},
    ],
    ids=repr,
)
def test_run_demo_rejects_bad_input(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument) as exc:
        run_demo(echo=False, **kwargs)
    assert isinstance(exc.value, ValueError)


def test_demo_text_ends_with_a_short_legend() -> None:
    done = tokenbelt("--limit", "2", "--produce-ms", "0", "--consume-ms", "0")
    assert done.returncode == 0, done.stderr
    legend = done.stdout.split("\n\n")[-1]
    for term in ("belt", "buffer peak", "end reason", "cancel to release"):
        assert term in legend


def test_a_natural_end_prints_a_dash_for_cancel_to_release() -> None:
    """All 1000 scripted tokens read: nothing was cancelled, so there is no figure."""
    done = tokenbelt("--limit", "1000", "--produce-ms", "0", "--consume-ms", "0")
    assert done.returncode == 0, done.stderr
    assert "None" not in done.stdout
    assert re.search(r"^end reason\s+(stop|user_cancel)$", done.stdout, re.MULTILINE)
    assert re.search(r"^cancel to release\s+(—|\d+(\.\d+)? ms)$", done.stdout, re.MULTILINE)
    summary = json.loads(
        tokenbelt("--limit", "1000", "--produce-ms", "0", "--consume-ms", "0", "--json").stdout
    )
    assert summary["consumed"] == 1000


def test_natural_end_text_shows_a_dash(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenbelt.cli import _demo

    summary = DemoSummary(3, 3, 1, "stop", None)
    monkeypatch.setattr(_demo, "run_demo", lambda **_kwargs: summary)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cancel to release\s+—$", out, re.MULTILINE)


def test_limit_above_the_script_is_refused() -> None:
    done = tokenbelt("--limit", "1001")
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line
    assert "the scripted producer has 1000 tokens" in line
    with pytest.raises(InvalidArgument, match="at most the 1000 scripted tokens"):
        run_demo(limit=1001, echo=False)


@pytest.mark.parametrize("value", ["-1", "inf", "x"])
def test_both_ms_flags_follow_one_rule(value: str) -> None:
    produce = tokenbelt(f"--produce-ms={value}").stderr.split("error: ")[1]
    consume = tokenbelt(f"--consume-ms={value}").stderr.split("error: ")[1]
    assert produce.replace("--produce-ms", "FLAG") == consume.replace("--consume-ms", "FLAG")
    assert ">= 0" in produce


def test_zero_ms_is_accepted_by_both_flags() -> None:
    done = tokenbelt("--limit", "2", "--produce-ms", "0", "--consume-ms", "0", "--json")
    assert done.returncode == 0, done.stderr
