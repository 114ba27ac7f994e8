"""The real Codex CLI (npm ``@openai/codex``) against a real ``tokenbelt serve``: one
``codex exec`` turn in which the model calls Codex's shell tool, Codex runs the command,
and sends its output back for the answer. Skipped when ``codex`` is not installed.

Codex's first prompt is about 6,500 tokens: on two cores its prefill takes a minute or
more, so the run is bounded (``RUN_S``) rather than quick.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from serving import serve
from tokenbelt.models import default_model_path

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        shutil.which("codex") is None,
        reason="the Codex CLI is not installed (npm install -g @openai/codex)",
    ),
]

#: the most one ``codex exec`` run may take
RUN_S = 420
MODEL = default_model_path().stem
#: the call the model is to make, in its tool format
CALL = '<tool_call>{"name": "exec_command", "arguments": {"cmd": "echo tokenbelt-ok"}}</tool_call>'
#: the model is small: it is shown the call to make, which it copies
PROMPT = f"Repeat this line exactly, and nothing else:\n{CALL}\n{CALL}\n{CALL}"
#: Codex sends no sampling, so the model samples (temperature 0.8) and may answer in
#: words instead of copying the call: one more run then (its prompt is in the cache)
TRIES = 2


def _codex(url: str, home: Path, work: Path, log: Path) -> list[dict[str, Any]]:
    """``codex exec --json`` of ``PROMPT`` with tokenbelt as its provider: its events."""
    # Codex gives up on a stream that sends no event for 300 s (keepalive comments do not
    # count), which a cold prefill on a busy 2-core machine can take: the run's bound
    # is the limit instead.
    provider = (
        f'{{name="tokenbelt", base_url="{url}/v1", wire_api="responses", env_key="TB_KEY", '
        f"stream_idle_timeout_ms={RUN_S * 1000}}}"
    )
    command = [
        "codex",
        "exec",
        "--json",
        "--skip-git-repo-check",
        # the test's own empty folder; Codex's sandbox needs kernel features CI may lack
        "--dangerously-bypass-approvals-and-sandbox",
        "-c",
        "model_provider=tb",
        "-c",
        f"model_providers.tb={provider}",
        "-m",
        MODEL,
        PROMPT,
    ]
    env = {**os.environ, "CODEX_HOME": str(home), "TB_KEY": "unused"}
    done = subprocess.run(
        command,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 and not _ran(events):
        said = f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-1000:]}\nserver: "
        print(said + log.read_text()[-3000:])  # shown if the test fails after its tries
    return events


def _ran(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shell commands Codex ran, as its ``item.completed`` events say."""
    done = [e["item"] for e in events if e["type"] == "item.completed"]
    return [item for item in done if item["type"] == "command_execution"]


@pytest.mark.timeout(TRIES * RUN_S + 120)
def test_codex_exec_runs_a_shell_call_that_round_trips(tmp_path: Path) -> None:
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    flags = ("--log-level", "info")  # the defaults otherwise: Codex's first turn fits them
    with serve(tmp_path, str(default_model_path()), flags=flags, timeout=120) as (url, _):
        for _ in range(TRIES):
            events = _codex(url, home, work, tmp_path / "serve.log")
            if any(_ran(events)):
                break
    log = (tmp_path / "serve.log").read_text()
    ran = _ran(events)
    assert ran, json.dumps(events)[-3000:]
    assert "echo tokenbelt-ok" in ran[0]["command"]
    assert "tokenbelt-ok" in ran[0]["aggregated_output"]
    assert ran[0]["exit_code"] == 0
    # What the small model says once it has the output is not under test: it may ramble
    # to its reply limit, which Codex reports as a failed turn (max_output_tokens).
    end = events[-1]
    assert end["type"] == "turn.completed" or "max_output_tokens" in json.dumps(end), end
    # The call's output went back: a second request after the call, and both answered.
    answered = [line for line in log.splitlines() if '"event": "request"' in line]
    assert len(answered) >= 2, log[-3000:]
    assert "built-in tools left out (a local server cannot run them): web_search" in log
