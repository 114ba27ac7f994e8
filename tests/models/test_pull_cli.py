"""``tokenbelt models pull`` in real processes: one download for two processes, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tokenbelt.models import Home
from tokenbelt.models._download import partial_path

from .conftest import payload, url_entry, write_user_catalog
from .fileserver import FileServer, Served

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def start(home: Home, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, TOKENBELT_HOME=str(home.data_dir))
    return subprocess.Popen(
        [sys.executable, "-m", "tokenbelt", "models", "pull", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def test_two_processes_pull_one_file_once(server: FileServer, home: Home) -> None:
    gate = threading.Event()
    served = server.files["/m.gguf"] = Served(payload(), gate=gate)
    write_user_catalog(home, url_entry("m", server.url("/m.gguf"), served))
    first = start(home, "m")
    second: subprocess.Popen[str] | None = None
    try:
        assert server.requested.wait(20), "the first process reached the server"
        second = start(home, "m")
        assert second.stderr is not None
        line = second.stderr.readline()
        assert "waiting for another process that is downloading m" in line
    finally:
        gate.set()
        results = [finish(p) for p in (first, second) if p is not None]
    for code, out, err in results:
        assert code == 0, err
        assert "m-q8-cpu ready on cpu" in out
    assert len(server.gets) == 1, "the server saw one GET of the body"
    dest = home.models_dir / "m-q8-cpu.gguf"
    assert dest.read_bytes() == served.data


def wait_for_size(path: Path, size: int, limit: float = 10.0) -> None:
    """Wait (bounded) until another process has written ``size`` bytes to ``path``."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size >= size:
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} never reached {size} bytes")


def test_ctrl_c_keeps_a_resumable_partial(server: FileServer, home: Home) -> None:
    served = server.files["/m.gguf"] = Served(payload(), stall_at=200_000)
    write_user_catalog(home, url_entry("m", server.url("/m.gguf"), served))
    partial = partial_path(home.models_dir / "m-q8-cpu.gguf")
    proc = start(home, "m")
    try:
        assert server.stalled.wait(20)
        wait_for_size(partial, 200_000)
        proc.send_signal(signal.SIGINT)
        code, _out, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130
    assert "pull of m cancelled; an http(s) download keeps its partial file" in err
    assert "Traceback" not in err
    assert partial.stat().st_size == 200_000

    server.release.set()
    code, _out, err = finish(start(home, "m"))
    assert code == 0, err
    assert server.gets[-1].range == "bytes=200000-"
    assert (home.models_dir / "m-q8-cpu.gguf").read_bytes() == served.data


def test_stalled_server_is_a_one_line_error(server: FileServer, home: Home) -> None:
    served = server.files["/m.gguf"] = Served(payload(), stall_at=100_000)
    write_user_catalog(home, url_entry("m", server.url("/m.gguf"), served))
    code, _out, err = finish(start(home, "m", "--stall-timeout", "0.5"))
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("tokenbelt:")]
    assert len(lines) == 1
    assert "stalled: no data from 127.0.0.1" in lines[0]
    assert "pull again to resume" in lines[0]
    assert "Traceback" not in err
