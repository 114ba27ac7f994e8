"""Upstream and front servers as processes of their own, on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import pytest

import plainhttp
from serving import free_port

HERE = Path(__file__).parent


class Process:
    """A server process: its URL, its log, and a way to kill it hard."""

    def __init__(
        self,
        command: Sequence[str],
        url: str,
        log: Path,
        ready: str,
        env: Mapping[str, str] | None = None,
        group: bool = False,
    ) -> None:
        self.command = list(command)
        self.url = url
        self.log = log
        self.ready = ready
        self.env = None if env is None else dict(env)
        #: a process group of its own, signalled whole: a server whose children (vLLM's
        #: engine core) would outlive it, orphaned, when only it is killed
        self.group = group
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> Process:
        return self.launch().wait_ready(timeout)

    def launch(self) -> Process:
        """Start the process; ``wait_ready`` waits for it (several may start at once)."""
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=self.group,
            )
        return self

    def wait_ready(self, timeout: float = 90.0) -> Process:
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"{self.command} exited:\n{self.log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if plainhttp.get(self.url + self.ready, timeout=2.0).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                log = self.log.read_text()[-4000:]
                pytest.fail(f"{self.command} not ready after {timeout} s:\n{log}")
            time.sleep(0.1)

    def _signal(self, signum: int) -> None:
        assert self.process is not None
        if self.group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL: no goodbye on any connection, as a crashed server."""
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        if self.group:  # what the group's leader left behind (it was killed, say)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


@contextlib.contextmanager
def running(*processes: Process) -> Iterator[None]:
    try:
        for p in processes:
            p.start()
        yield
    finally:
        for p in processes:
            p.stop()


def scripted_upstream(tmp: Path, tokens: int = 400, delay: float = 0.02) -> Process:
    port = free_port()
    command = [sys.executable, str(HERE / "scripted_upstream.py"), str(port), str(tokens)]
    command.append(str(delay))
    return Process(command, f"http://127.0.0.1:{port}", tmp / f"up-{port}.log", "/health")


def front_process(tmp: Path, *upstreams: str, extra: Sequence[str] = ()) -> Process:
    """``tokenbelt serve --upstream URL ...``."""
    port = free_port()
    command = [sys.executable, "-m", "tokenbelt", "serve", "--port", str(port)]
    for u in upstreams:
        command += ["--upstream", u]
    command += ["--log-level", "warning", *extra]
    return Process(command, f"http://127.0.0.1:{port}", tmp / f"front-{port}.log", "/health")
