"""``tokenbelt transcribe FILE`` in a terminal: the words of real speech print as the
model decodes them, Ctrl-C stops the model and says when it let go, a file that is not
audio is one error line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

import speech

pytestmark = pytest.mark.model

NET_S = 60.0


@pytest.fixture(scope="module")
def minute(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return speech.speak(" ".join(speech.MINUTE), tmp_path_factory.mktemp("speech") / "m.wav")


def test_segments_print_as_decoded_and_ctrl_c_stops_the_model(minute: Path) -> None:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "tokenbelt", "transcribe", str(minute), "--timestamps"],
        encoding="utf-8",
        timeout=NET_S,
        env={**os.environ, "TERM": "xterm"},
    )
    try:
        child.expect(r"\[\s*0\.00 -> \s*[\d.]+\] (.+)\r\n")
        first = child.match.group(1)
        assert speech.word_match(first, speech.MINUTE[0]) >= speech.WORD_MATCH, first
        child.sendintr()
        child.expect(r"tokenbelt: stopped; the model let go (\d+) ms later")
        child.expect(pexpect.EOF)
    finally:
        if child.isalive():
            child.terminate(force=True)
        child.close()
    assert child.exitstatus == 130
    # Not every sentence was printed: the model stopped.
    assert len(re.findall(r"\] ", child.before or "")) < len(speech.MINUTE)


def test_a_file_that_is_not_audio_is_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "notes.wav"
    bad.write_text("not audio at all " * 30)
    done = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "transcribe", str(bad)],
        capture_output=True,
        text=True,
        timeout=NET_S,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "could not be decoded as audio" in lines[0]
