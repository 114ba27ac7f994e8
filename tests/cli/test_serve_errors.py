"""``tokenbelt serve`` refusing to start says so in one line of its own, naming itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tokenbelt.models import default_model_path


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenbelt", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_a_port_in_use_is_one_line_of_tokenbelts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve(str(default_model_path()), "--port", str(port))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"tokenbelt: error: cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use"
    ], done.stderr


def test_an_unknown_flag_is_named_by_the_command_it_was_given_to() -> None:
    done = serve("--prot", "1")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "tokenbelt serve: error: unrecognized arguments: --prot"
    )


def test_an_engine_setting_that_cannot_be_is_one_line_before_any_load() -> None:
    done = serve(str(default_model_path()), "--kv-type", "q8_0", "--flash-attn", "off")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "tokenbelt: error: a q8_0 KV cache needs flash attention: flash_attn (--flash-attn) "
        "'auto' or 'on', not 'off'"
    ], done.stderr
