"""A real ``tokenbelt serve`` process for end-to-end tests (web page, terminal chat)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import plainhttp
from tokenbelt.models import default_model_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def serve(
    tmp: Path,
    *aliases: str,
    flags: tuple[str, ...] = (),
    timeout: float = 60.0,
    log_level: str = "warning",
    new_session: bool = False,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``tokenbelt serve ALIASES`` on 127.0.0.1 (a free port) until the block ends.

    Yields the base URL and the process once ``/health`` says ready; fails the test
    (with the server's log) if it exits or is not ready within ``timeout`` seconds.
    ``flags`` come last (a later ``--log-level`` wins); the log is ``tmp / "serve.log"``.
    ``new_session``: the server leads a process group of its own (its workers in it), as
    a service manager starts it.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "serve.log"
    command = [sys.executable, "-m", "tokenbelt", "serve", *aliases]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", log_level, *flags]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=new_session
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                pytest.fail(f"tokenbelt serve exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if plainhttp.get(f"{url}/health", timeout=2.0).json().get("status") == "ok":
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"tokenbelt serve was not ready after {timeout} s:\n{log.read_text()}")
            time.sleep(0.1)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def serve_default_model(
    tmp: Path, timeout: float = 60.0, extra: tuple[str, ...] = (), model: Path | None = None
) -> Iterator[str]:
    """Run ``tokenbelt serve <default model>`` (see ``serve``) and yield its URL.

    ``extra``: flags. ``model``: another GGUF file to serve (a test copy of the default
    model).
    """
    served = model if model is not None else default_model_path()
    with serve(tmp, str(served), flags=extra, timeout=timeout) as (url, _):
        yield url
