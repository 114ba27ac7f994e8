"""``tokenbelt chat`` commands and keys, through a pseudo-terminal (pexpect).

Commands never reach the model; text typed while a reply streams is neither echoed
into it nor sent behind the user's back: it comes back as the next prompt's draft.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from serving import serve_default_model
from tokenbelt.models import default_model_path

from .test_chat import LONG, NET_S, PROMPT, STATUS, WORDY, chat

pytestmark = pytest.mark.model


def _statuses(transcript: str) -> list[re.Match[str]]:
    return list(STATUS.finditer(transcript))


def test_the_first_line_is_the_startup_line_and_commands_stay_local() -> None:
    with chat("--max-tokens", "8", "--temperature", "0") as child:
        child.expect_exact(PROMPT)
        opening = child.before
        assert isinstance(opening, str)
        # No stray blank line: before the startup line, each newline the loading spinner
        # wrote is taken back by its cursor-up when it goes away.
        head, _, rest = opening.partition("loaded in ")
        assert rest, repr(opening)
        assert head.count("\n") == head.count("\x1b[1A"), repr(head)
        plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", rest).replace("\r\n", "")
        assert re.search(r"smollm2-135m on cpu, .*threads.*context \d+ tokens per sequence", plain)
        assert f"file {default_model_path()}" in plain

        child.sendline("/help")
        for command in ("/clear", "/undo", "/system TEXT", "/model NAME", "/exit"):
            child.expect_exact(command)
        child.expect_exact(PROMPT)

        child.sendline("/undo")
        child.expect_exact("nothing to undo")
        child.sendline("/system You answer in one word.")
        child.expect_exact("system prompt: You answer in one word.")
        child.sendline("/nope")
        child.expect_exact("unknown command /nope")

        child.sendline("Say hello.")
        child.expect(STATUS)
        child.expect_exact(PROMPT)
        child.sendline("/undo")
        child.expect_exact("took back the last exchange")
        child.sendline("/clear")
        child.expect_exact("conversation cleared")
        child.sendline("/model")
        child.expect_exact("usage: /model NAME")
        child.sendline("/model /no/such/file.gguf")
        child.expect_exact("error: file not found: /no/such/file.gguf")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        transcript = child.before
        child.close()
        assert child.exitstatus == 0
        assert isinstance(transcript, str)


def test_model_switches_and_the_chat_goes_on() -> None:
    path = str(default_model_path())
    with chat("--max-tokens", "8", "--temperature", "0") as child:
        child.expect_exact(PROMPT)
        child.sendline(f"/model {path}")
        child.expect(rf"loaded in [\d.]+ s: {re.escape(Path(path).stem)} on cpu")
        child.expect_exact(PROMPT)
        child.sendline("Say hello.")
        child.expect(STATUS)
        child.expect_exact(PROMPT)
        child.sendline("exit")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0


def test_typing_during_a_reply_becomes_the_next_draft_never_a_sent_message() -> None:
    """Keys pressed mid-reply (Enter included) are held: no echo, no ^C, no hidden send."""
    with chat("--max-tokens", "4000", *WORDY) as child:
        child.expect_exact(PROMPT)
        child.sendline(LONG)
        child.expect_exact("lighthouse keeper.")
        child.expect(r"(\w+[^\w\n]+){8}")
        child.send("and now a haiku\r")
        child.sendintr()
        child.expect_exact("[stopped]")
        reply = child.before
        assert isinstance(reply, str)
        assert "haiku" not in reply
        assert "^C" not in reply
        child.expect(STATUS)
        assert child.match is not None
        assert child.match["reason"] == "user_cancel"
        child.expect_exact("is your draft: Enter sends it")
        child.expect_exact(PROMPT + "and now a haiku")
        # Nothing is sent until Enter: Ctrl-U clears the draft, and a command follows.
        child.send("\x15")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        transcript = child.before
        child.close()
        assert child.exitstatus == 0
        assert isinstance(transcript, str)
        assert not _statuses(transcript), "the draft was never sent"


def test_a_reply_cut_by_max_tokens_says_so() -> None:
    with chat("--max-tokens", "3", "--temperature", "0") as child:
        child.expect_exact(PROMPT)
        child.sendline(LONG)
        child.expect(STATUS)
        assert child.match is not None
        assert child.match["reason"] == "length"
        child.expect_exact("the reply stopped at the 3-token limit")
        child.expect_exact("--max-tokens N")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)


def test_url_takes_the_root_or_v1_and_an_unknown_model_fails_at_start(tmp_path: Path) -> None:
    with serve_default_model(tmp_path, NET_S) as url:
        for given in (url, f"{url}/", f"{url}/v1", f"{url}/v1/"):
            with chat("--url", given, "--max-tokens", "8") as child:
                child.expect_exact(f"connected to {url}: model ")
                child.expect_exact(PROMPT)
                child.sendline("Hi")
                child.expect(STATUS)
                child.expect_exact(PROMPT)
                child.sendline("/exit")
                child.expect(pexpect.EOF)
        done = subprocess.run(
            [sys.executable, "-m", "tokenbelt", "chat", "--url", url, "no-such-model"],
            capture_output=True,
            text=True,
            timeout=NET_S,
            check=False,
        )
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert f"the server at {url} has no model 'no-such-model'" in lines[0]
        assert done.stdout == ""
