"""``benchmarks/soak.py``, short: mixed load over every dialect, resets and chaos (a kill
and a freeze of the worker), reconciled from the client, the traces, ``/metrics`` and the
log. Nothing mismatched, lost, hung or unreleased; no stream without its terminal event;
no queued request failed by the kill; no kill that no one asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.mark.timeout(150)
def test_a_short_soak_with_chaos_reconciles() -> None:
    command = [sys.executable, str(SOAK), "--json", "--requests", "16", "--clients", "4"]
    command += ["--resets", "3", "--reset-within", "1", "--max-tokens", "8", "--timeout", "60"]
    command += ["--chaos", "--kills", "1", "--freeze", "1", "--chaos-gap", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=140, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # 16 + 3 resets at least; more while the kill and the freeze are still to come
    assert result["requests"] >= 19, result
    for key in ("mismatches", "lost", "hung", "unreleased", "no_terminal", "queued_failed"):
        assert result[key] == 0, (key, result)
    assert result["unasked_kills"] == 0, result
    assert result["injected"]["kills"] == 1, result
    assert result["metrics_mismatch"] is False, result
    assert result["log_mismatch"] is False, result
    assert result["log_not_honoured"] == 0, result
    assert set(result["by_kind"]) >= {"openai-stream", "ollama-stream", "anthropic-stream"}
