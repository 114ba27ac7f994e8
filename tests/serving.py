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
def serve_default_model(
    tmp: Path, timeout: float = 60.0, extra: tuple[str, ...] = (), model: Path | None = None
) -> Iterator[str]:
    """Run ``tokenbelt serve <default model>`` on 127.0.0.1 until the block ends.

    Yields the base URL once ``/health`` says ready; fails the test (with the
    server's log) if it exits or is not ready within ``timeout`` seconds. ``extra``
    flags come last (a later ``--log-level`` wins); the log is ``tmp / "serve.log"``.
    ``model``: another GGUF file to serve (a test copy of the default model).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "serve.log"
    served = model if model is not None else default_model_path()
    command = [sys.executable, "-m", "tokenbelt", "serve", str(served)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
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
        yield url
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
