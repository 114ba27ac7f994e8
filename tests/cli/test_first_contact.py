"""The command line as a newcomer meets it: version, usage, help, startup line, bad paths.

Every command runs as a real subprocess (``python -m tokenbelt``), the way it is typed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving import free_port
from tokenbelt import Runtime, ScriptedEngine, __version__
from tokenbelt._defaults import DEFAULT_MAX_TOKENS
from tokenbelt.cli import build_parser
from tokenbelt.cli._common import startup_line
from tokenbelt.models import default_model_path

NET_S = 60.0


def tokenbelt(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenbelt", *args],
        capture_output=True,
        text=True,
        timeout=NET_S,
        check=False,
        env={**os.environ, "COLUMNS": "100", **env},
    )


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_version() -> None:
    done = tokenbelt("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"tokenbelt {__version__}"


@pytest.mark.parametrize(
    ("args", "listed"),
    [
        ([], ["demo", "serve", "chat", "models", "probe"]),
        (["models"], ["list", "pull", "verify", "rm", "add"]),
    ],
)
def test_a_bare_command_shows_its_usage(args: list[str], listed: list[str]) -> None:
    done = tokenbelt(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("usage: tokenbelt")
    for name in listed:
        assert re.search(rf"^\s+{name}\s", done.stderr, re.MULTILINE), (name, done.stderr)
    assert done.stderr.rstrip().endswith("error: choose a command")


HELPS = [
    [],
    ["demo"],
    ["serve"],
    ["chat"],
    ["probe"],
    ["models"],
    ["models", "list"],
    ["models", "pull"],
    ["models", "verify"],
    ["models", "rm"],
    ["models", "add"],
]


@pytest.mark.parametrize("command", HELPS, ids=lambda c: " ".join(c) or "tokenbelt")
def test_every_help_names_the_environment_and_hides_the_key(command: list[str]) -> None:
    done = tokenbelt(*command, "--help", TOKENBELT_API_KEY="sekrit-key")
    assert done.returncode == 0, done.stderr
    for name in ("TOKENBELT_HOME", "TOKENBELT_API_KEY", "HF_ENDPOINT"):
        assert name in done.stdout
    assert "sekrit-key" not in done.stdout


def _flat(text: str) -> str:
    return " ".join(text.split())


def _help_entries(text: str) -> dict[str, str]:
    """``--flag``: its help text, from argparse's option block (one entry per flag)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0].splitlines():
        start = re.match(r"^  (-\S+(?:, -\S+)*)(?: [A-Z_{},a-z]+)?(?:  +(.*))?$", line)
        if start:
            current = start[1].split(", ")[-1]
            entries[current] = start[2] or ""
        elif current is not None:
            entries[current] += " " + line.strip()
    return {k: v.strip() for k, v in entries.items()}


def _options(command: str) -> list[argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if a.option_strings and a.nargs != 0]


@pytest.mark.parametrize("command", ["serve", "chat", "demo", "probe"])
def test_help_shows_every_default(command: str) -> None:
    """Every option with a default says it (the issue's list: capacity 8, slots, queue 16,
    keep-alive 300 s), and one without says what happens instead."""
    entries = _help_entries(tokenbelt(command, "--help").stdout)
    for action in _options(command):
        flag = action.option_strings[-1]
        help_text = (flag, entries[flag])
        if action.default in (None, False, []):
            assert "default" in help_text[1] or flag == "--url", (flag, help_text[1])
            continue
        shown = f"{action.default:g}" if isinstance(action.default, float) else action.default
        assert f"(default {shown}" in help_text[1], (flag, help_text[1])


def test_serve_help_names_the_reply_limit_and_the_keep_alive_rule() -> None:
    out = _flat(tokenbelt("serve", "--help").stdout)
    for flag, default in [("--capacity", "8"), ("--queue-size", "16")]:
        assert re.search(rf"{flag} \S+ .*?\(default {default}[;)]", out), (flag, out)
    assert re.search(r"--n-ctx \S+ .*?not given, what each model was trained on", out)
    assert re.search(r"--keep-alive \S+ .*?\(default 300\)", out)
    assert f"at most {DEFAULT_MAX_TOKENS} tokens" in out
    assert "counted from the load" in out


def test_chat_help_shows_the_reply_limit_and_the_commands() -> None:
    out = _flat(tokenbelt("chat", "--help").stdout)
    assert f"longest reply, in tokens (default {DEFAULT_MAX_TOKENS})" in out
    for command in ("/help", "/clear", "/undo", "/system TEXT", "/model NAME", "/exit"):
        assert command in out


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_a_missing_model_file_is_file_not_found(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    done = tokenbelt(command, str(missing))
    assert done.returncode == 1
    assert one_error_line(done.stderr) == f"tokenbelt: error: file not found: {missing}"


def test_chat_with_an_unknown_alias_fails_at_start() -> None:
    done = tokenbelt("chat", "no-such-model")
    assert done.returncode == 1
    assert "unknown model 'no-such-model'" in one_error_line(done.stderr)


def test_startup_line_prints_what_is_known_and_falls_back() -> None:
    with Runtime(keep_alive=None, n_threads=3) as rt:
        model = rt.add_engines("scripted", lambda: [ScriptedEngine(["hi"], context_length=1024)])
        line = startup_line(model, rt, "http://127.0.0.1:1")
        assert line == (
            "scripted on cpu, 3 threads, context 1024 tokens per sequence, 1 slot, "
            "file unknown, http://127.0.0.1:1"
        )
        model.info.update(
            device="cuda",
            path="/m.gguf",
            threads=4,
            threads_batch=8,
            n_ctx_per_seq=2048,
            slots=4,
        )
        assert startup_line(model, rt) == (
            "scripted on cuda, 4 threads (8 for prompts), context 2048 tokens per sequence, "
            "4 slots, file /m.gguf"
        )
        model.info.update(decode_nice=10)  # a loaded model's (Runtime.load says it)
        assert startup_line(model, rt).startswith(
            "scripted on cuda, 4 threads (8 for prompts) at nice +10, context 2048"
        )


@pytest.mark.model
def test_serve_prints_one_ready_line_with_device_threads_context_file_and_url(
    tmp_path: Path,
) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "tokenbelt", "serve", "smollm2-135m", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + NET_S
        while "ready:" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(15)
    (ready,) = [line for line in log.read_text().splitlines() if "ready:" in line]
    assert re.search(
        rf"ready: smollm2-135m on cpu, in worker process \d+, (\d+|auto) threads.*, "
        rf"context 8192 tokens per sequence, 4 slots, "
        # what the context and the prefix cache cost, said before the first request
        rf"KV cache 720 MiB \(the model's trained length\), "
        rf"prefix cache up to 46603 tokens \(1024 MiB in memory, kept in \S+\), "
        rf"file {re.escape(str(default_model_path()))}, http://127\.0\.0\.1:{port}$",
        ready,
    ), ready


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("1024", 1024), ("500kB", 500_000), ("64MiB", 64 << 20), ("1.5GiB", 3 << 29)],
)
def test_a_byte_size_takes_a_unit(text: str, size: int) -> None:
    from tokenbelt.cli._common import byte_size

    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["12XB", "MiB", "-1", "ten"])
def test_a_bad_byte_size_is_one_error_line(text: str) -> None:
    import argparse

    from tokenbelt.cli._common import byte_size

    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)
