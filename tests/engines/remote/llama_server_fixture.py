"""A real llama.cpp ``llama-server`` for the remote engine's tests: one per test session.

The binary is ``$TOKENBELT_LLAMA_SERVER``, or, with ``TOKENBELT_LLAMA_SERVER_BUILD=1``,
one built once by ``benchmarks/build_llama_server.sh`` from the llama-cpp-python sdist of
the version installed here (the very llama.cpp tokenbelt runs) and kept in
``~/.cache/tokenbelt/llama-server-VERSION`` (``$XDG_CACHE_HOME`` moves it; about 15
minutes on two cores the first time); elsewhere, and where it cannot be built (no
network, no compiler), the tests skip, saying why.

The server serves the embedded default model as ``smol`` with two slots of 2048 tokens on
one thread, ``--no-repack`` (llama.cpp's AMX kernels, which a repack picks on a CPU with
AMX, crash on batches of two tokens or more) and ``--slots`` (its ``/slots`` is what
confirms a release; on by default in recent versions, off in older ones).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.remote.processes import Process
from serving import free_port
from tokenbelt.models import default_model_path

BINARY = "TOKENBELT_LLAMA_SERVER"
BUILD = "TOKENBELT_LLAMA_SERVER_BUILD"
#: the served model's name
MODEL = "smol"
#: its slots (two: a stop confirmed while the other slot is still at work)
SLOTS = 2
SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "build_llama_server.sh"


class Unavailable(Exception):
    """No llama-server here: why."""


def version() -> str:
    """The llama-cpp-python installed here: its sdist vendors the llama.cpp built."""
    return importlib.metadata.version("llama-cpp-python")


def cache() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "tokenbelt" / f"llama-server-{version()}"


def build() -> Path:
    """The cached binary, built first if it is not (blocking: minutes, once; one build at
    a time across processes). ``.ready`` in the cache holds the path the build printed."""
    folder = cache()
    ready = folder / ".ready"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists() and Path(ready.read_text().strip()).is_file():
            return Path(ready.read_text().strip())
        log = folder / "build.log"
        env = {**os.environ, "LCP_VERSION": version(), "JOBS": str(len(os.sched_getaffinity(0)))}
        with log.open("wb") as out:
            done = subprocess.run(
                ["bash", str(SCRIPT), str(folder)], stdout=subprocess.PIPE, stderr=out, env=env
            )
        if done.returncode != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise Unavailable(f"the build failed (exit {done.returncode}, log {log}): {tail}")
        built = Path(done.stdout.decode().strip().splitlines()[-1])
        if not built.is_file():
            raise Unavailable(f"the build printed {built}, which is no file (log {log})")
        ready.write_text(f"{built}\n")
    return built


def binary() -> Path:
    """The llama-server to test (see the module); raises ``Unavailable`` saying why not."""
    given = os.environ.get(BINARY)
    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise Unavailable(f"{BINARY}={given} is no executable file")
        return path
    if os.environ.get(BUILD) == "1":
        return build()
    raise Unavailable(
        f"a real llama-server runs with {BINARY}=PATH, or {BUILD}=1 to build one into "
        f"{cache()} (scripts/test's step after the main run)"
    )


def llama_server_process(tmp: Path, path: Path, *, slots: bool = True) -> Process:
    """llama-server as the module says (``slots``: with ``/slots``, else ``--no-slots``)."""
    port = free_port()
    command = [str(path), "-m", str(default_model_path()), "--alias", MODEL]
    command += ["--host", "127.0.0.1", "--port", str(port), "-np", str(SLOTS)]
    command += ["-c", str(2048 * SLOTS), "-t", "1", "-tb", "1", "--no-repack", "--no-webui"]
    command.append("--slots" if slots else "--no-slots")
    return Process(command, f"http://127.0.0.1:{port}", tmp / f"llama-server-{port}.log", "/health")


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """The llama-server to test (built first where the module says)."""
    try:
        return binary()
    except Unavailable as exc:
        pytest.skip(f"no llama-server here: {exc}")


@pytest.fixture(scope="session")
def llama_server(
    llama_server_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The URL of the session's llama-server (started on first use)."""
    server = llama_server_process(tmp_path_factory.mktemp("llama-server"), llama_server_binary)
    try:
        server.start(120.0)
        yield server.url
    finally:
        server.stop()
