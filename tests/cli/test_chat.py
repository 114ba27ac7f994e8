"""``tokenbelt chat`` through a pseudo-terminal: replies stream, Ctrl-C stops the model.

Each test spawns the real command (``python -m tokenbelt chat``) in a pty with pexpect,
the way a person runs it. In-process chats load the real default model; the ``--url``
test talks to a real ``tokenbelt serve`` subprocess.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pexpect
import psutil
import pytest

import plainhttp
from serving import free_port, serve_default_model
from tokenbelt.cli._chat_remote import RemoteBackend
from tokenbelt.models import default_model_path

PROMPT = "you> "
#: a safety net for each expected output (the model loads and answers in seconds)
NET_S = 45.0
LONG = "Write a very long story, at least two thousand words, about a lighthouse keeper."
#: a seed whose reply to LONG is words: unseeded, the small model sometimes answers
#: with a run of emoji, and a test that waits for eight streamed words then times out
WORDY = ("--seed", "7")
STATUS = re.compile(
    r"first token (?P<ttft>[\d.]+|-)( ms)?, (?P<rate>[\d.]+|-) tok/s, "
    r"end (?P<reason>\w+)(, cancel to release (?P<ctr>[\d.]+|-)( ms)?)?"
    r"(?P<late> \(not released yet\))?"
)


@contextlib.contextmanager
def chat(*args: str, columns: int = 120, sigint_ignored: bool = False) -> Iterator[pexpect.spawn]:
    """``tokenbelt chat ARGS`` in a pty; killed at the end if it is still running.
    ``sigint_ignored``: started as a shell without job control starts ``cmd &``."""
    env = {**os.environ, "TERM": "xterm", "COLUMNS": str(columns), "LINES": "40"}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "tokenbelt", "chat", *args],
        encoding="utf-8",
        timeout=NET_S,
        dimensions=(40, columns),
        env=env,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if sigint_ignored
        else None,
    )
    try:
        yield child
    finally:
        if child.isalive():
            child.terminate(force=True)
        child.close()


def _stop_mid_reply(child: pexpect.spawn) -> re.Match[str]:
    """Ask for a long reply, wait until words stream in, press Ctrl-C; the status line."""
    child.expect_exact(PROMPT)
    child.sendline(LONG)
    child.expect_exact("lighthouse keeper.")  # the terminal's echo of the line
    child.expect(r"(\w+[^\w\n]+){8}")  # eight words of the reply have streamed in
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect(STATUS)
    match = child.match
    assert isinstance(match, re.Match)
    child.expect_exact(PROMPT)
    return match


@pytest.mark.model
def test_a_reply_streams_and_ctrl_d_exits() -> None:
    with chat(str(default_model_path()), "--max-tokens", "16", "--temperature", "0") as child:
        child.expect_exact(PROMPT)
        child.sendline("Say hello.")
        child.expect_exact("Say hello.")
        child.expect(STATUS)
        reply = child.before
        assert child.match is not None
        assert child.match["reason"] in {"stop", "length"}
        assert child.match["ctr"] is None  # nothing was cancelled: no cancel to release
        assert re.search(r"\w", reply), reply
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0


@pytest.mark.model
def test_a_reply_wraps_at_word_boundaries_at_the_terminal_edge() -> None:
    with chat(str(default_model_path()), "--max-tokens", "80", *WORDY, columns=60) as child:
        child.expect_exact(PROMPT)
        child.sendline("Describe the sea in three sentences.")
        child.expect_exact("sentences.")
        child.expect(STATUS)
        lines = [line for line in child.before.split("\r\n") if line.strip()]
        assert len(lines) >= 2, lines  # a reply longer than one line
        # Every line break is ours (the terminal never had to cut a line) and falls
        # between words: no line is wider than the terminal or ends inside a word.
        assert all(len(line) <= 60 for line in lines), lines
        for line, following in itertools.pairwise(lines):
            assert len(line) < 60 or not (line[-1].isalnum() and following[0].isalnum()), lines
        child.expect_exact(PROMPT)  # a Ctrl-D sent before readline reads the terminal is lost
        child.sendeof()
        child.expect(pexpect.EOF)


@pytest.mark.model
def test_ctrl_c_mid_reply_stops_generation_and_the_prompt_returns() -> None:
    """Ctrl-C cancels the request (``user_cancel``), waits for the release, prompts again.

    The status line is printed only after the engine released the request (it would say
    "not released yet" otherwise) and carries the cancel-to-release figure. A Ctrl-C at
    the empty prompt then ends the chat with status 0.
    """
    with chat(str(default_model_path()), "--max-tokens", "4000", *WORDY) as child:
        status = _stop_mid_reply(child)
        assert status["reason"] == "user_cancel"
        assert float(status["ctr"]) >= 0
        assert status["late"] is None
        child.sendintr()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0


@pytest.mark.model
def test_ctrl_c_stops_a_chat_started_with_sigint_ignored() -> None:
    """Ctrl-C is the chat's Stop key even when it was started with SIGINT ignored."""
    with chat(
        str(default_model_path()), "--max-tokens", "4000", *WORDY, sigint_ignored=True
    ) as child:
        assert _stop_mid_reply(child)["reason"] == "user_cancel"


@pytest.mark.model
def test_ctrl_c_with_the_model_in_a_worker_process_stops_the_reply_not_the_worker() -> None:
    """The terminal's Ctrl-C reaches the whole process group, the worker too: the worker
    ignores it, the chat stops the reply, and the same worker answers the next question."""
    with chat(
        str(default_model_path()), "--max-tokens", "4000", *WORDY, "--isolation", "process"
    ) as c:
        c.expect(r"in worker process (\d+)")
        assert c.match is not None
        pid = int(c.match[1])
        status = _stop_mid_reply(c)
        assert status["reason"] == "user_cancel"
        assert status["late"] is None
        c.sendline("Say hello.")
        c.expect_exact("Say hello.")
        c.expect(STATUS)
        assert c.match is not None
        assert c.match["reason"] in {"stop", "length"}
        assert psutil.pid_exists(pid)  # the same worker served it
        c.expect_exact(PROMPT)
        c.sendeof()
        c.expect(pexpect.EOF)
        c.close()
        assert c.exitstatus == 0
    assert not psutil.pid_exists(pid)  # the chat ended, and its worker with it


@pytest.mark.model
@pytest.mark.parametrize("where", ["mid-reply", "at-the-prompt"])
def test_sigterm_ends_the_reply_with_shutdown_and_exits_0(where: str) -> None:
    with chat(str(default_model_path()), "--max-tokens", "4000", *WORDY) as child:
        child.expect_exact(PROMPT)
        if where == "mid-reply":
            child.sendline(LONG)
            child.expect_exact("lighthouse keeper.")
            child.expect(r"(\w+[^\w\n]+){8}")  # the reply is streaming
        child.kill(signal.SIGTERM)
        if where == "mid-reply":
            child.expect_exact("terminated (SIGTERM): the reply ended with shutdown")
        else:
            child.expect_exact("terminated (SIGTERM)")
        child.expect(pexpect.EOF)
        assert "Traceback" not in (child.before or "")
        child.close()
        assert child.exitstatus == 0


@pytest.mark.model
def test_url_mode_cancels_at_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--url``, Ctrl-C calls the cancel endpoint: the server records ``user_cancel``
    (and the call goes out on a client made before the Stop)."""
    with (
        serve_default_model(tmp_path, NET_S) as url,
        chat("--url", url, "--max-tokens", "4000", *WORDY) as child,
    ):
        child.expect_exact(f"connected to {url}")
        status = _stop_mid_reply(child)
        assert status["reason"] == "user_cancel"
        assert status["late"] is None
        recent = plainhttp.get(f"{url}/v1/requests", params={"limit": 1}, timeout=10.0).json()
        trace = recent["data"][0]
        assert trace["end_reason"] == "user_cancel"
        assert trace["timeline_ms"]["released"] is not None
        assert status["ctr"] == f"{trace['cancel_to_release_ms']:.1f}"
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
        _stop_sends_at_once(url, monkeypatch)


def _stop_sends_at_once(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel call of a Stop goes out on a client made before it: a client made at
    the Stop first loads the CA bundle into a new SSL context (~65 ms of CPU here)."""
    backend = RemoteBackend(url, model=None, system=None, api_key=None, sampling={})
    try:
        turn = backend.start(LONG)
        pieces = iter(turn)
        next(pieces)
        contexts: list[object] = []
        made = ssl.create_default_context
        monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: contexts.append(a))
        turn.cancel()
        monkeypatch.setattr(ssl, "create_default_context", made)
        assert contexts == []
        record = plainhttp.get(f"{url}/v1/requests/{turn.request_id}", timeout=10.0).json()
        assert record["end_reason"] == "user_cancel"
    finally:
        backend.close()


@pytest.mark.parametrize(
    "args",
    [
        ["--max-tokens", "0"],
        ["--temperature", "3"],
        ["--temperature", "warm"],
        ["--seed", "-1"],
        ["--no-such-flag"],
        ["--url", "ftp://127.0.0.1:1"],
    ],
)
def test_bad_flags_are_one_line_errors_with_status_2(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "chat", *args],
        capture_output=True,
        text=True,
        timeout=NET_S,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "error" in result.stderr


def test_an_unreachable_url_is_a_one_line_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "chat", "--url", url],
        capture_output=True,
        text=True,
        timeout=NET_S,
        check=False,
    )
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cannot reach" in result.stderr


@pytest.mark.model
def test_a_thinking_model_reasons_dim_and_ctrl_c_stops_it_there(thinking_model: Path) -> None:
    """The reasoning streams dim (SGR 2) before the answer; Ctrl-C inside it stops the
    request there (``user_cancel``), released, and the prompt returns."""
    with chat(str(thinking_model), "--max-tokens", "4000", "--temperature", "0") as child:
        child.expect_exact(PROMPT)
        child.sendline(LONG)
        child.expect_exact("lighthouse keeper.")
        child.expect_exact("\x1b[2m")  # dim: the reasoning phase
        child.expect(r"(\w+[^\w\n]+){8}")
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect(STATUS)
        assert child.match is not None
        assert child.match["reason"] == "user_cancel"
        assert child.match["late"] is None
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
