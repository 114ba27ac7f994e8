"""What every benchmark script shares: its command line, ``--json``, the table, the targets.

Each script here runs as ``.venv/bin/python benchmarks/NAME.py``, so Python puts this
folder first on ``sys.path`` and the scripts import this module as ``_harness``. A script
keeps what it measures and how it lays out its own rows; this module holds only the
scaffolding they all repeated:

- :func:`parser` and :func:`parse`: an ``argparse`` parser described by the first line of
  the script's docstring, and ``--json`` (every script has it) added last;
- :func:`emit`: one JSON object on stdout with ``--json``, else the script's table;
- :func:`print_measures` (measure / value / target rows), :func:`print_keys` (one
  ``key: value`` line each) and :func:`targets_line` (``targets: all met`` or which
  missed);
- :func:`percentile`: the nearest-rank-from-below percentile several scripts report;
- :func:`text_times`: when each text chunk of a streamed ``/v1/completions`` arrived;
- :func:`free_port` and :func:`server_process`: a server in a process of its own on
  127.0.0.1 (``tokenbelt serve``, llama.cpp's ``llama-server``), ready once ``/health``
  says ``ok``;
- :func:`same_layout`: the ``llama-server`` flag that keeps its weights in the layout
  tokenbelt's engines use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose description is the first line of ``doc`` (the script's docstring)."""
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0])


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Add ``--json`` and parse ``argv`` (default: the command line)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def emit(result: Mapping[str, Any], as_json: bool, table: Callable[[Any], None]) -> None:
    """Print ``result`` as one JSON object when ``as_json``, else as ``table`` lays it out."""
    if as_json:
        print(json.dumps(result))
    else:
        table(result)


def print_measures(
    title: str, rows: Iterable[tuple[str, str, str]], width: int, target_width: int = 10
) -> None:
    """``title``, a blank line, then a ``measure / value / target`` table."""
    print(title)
    print()
    print(f"{'measure':<{width}} {'value':>10}  {'target':<{target_width}}")
    for name, value, target in rows:
        print(f"{name:<{width}} {value:>10}  {target:<{target_width}}")


def print_keys(result: Mapping[str, Any], keys: Iterable[str], width: int) -> None:
    """One right-aligned ``key: value`` line for each of ``keys``."""
    for key in keys:
        print(f"{key:>{width}}: {result[key]}")


def targets_line(targets: Mapping[str, bool]) -> str:
    """``targets: all met``, or the names of the targets missed."""
    missed = [name for name, ok in targets.items() if not ok]
    return "targets: all met" if not missed else f"targets missed: {', '.join(missed)}"


def percentile(values: Iterable[float], q: float) -> float:
    """The value at rank ``int(q * n)`` of the sorted values (the last one at most)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def text_times(lines: Iterable[str]) -> list[float]:
    """``perf_counter()`` as each SSE event of a completion stream that carries text is read.

    ``lines`` are the response's lines as they arrive (``httpx`` ``iter_lines()``); the
    clock is read right after each event is parsed, so a rate over these times is the
    client's view of the decode.
    """
    times: list[float] = []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choices = json.loads(line[len("data: ") :]).get("choices") or []
        if choices and choices[0].get("text"):
            times.append(time.perf_counter())
    return times


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def same_layout() -> list[str]:
    """``--no-repack`` where tokenbelt keeps weights in llama.cpp's plain CPU layout (a CPU
    with AMX: its kernels crash on a batch of two tokens or more at the commit tokenbelt
    runs), so that ``llama-server`` runs the same kernels and does not crash; else none."""
    from tokenbelt.engines import model_params

    return [] if model_params().use_extra_bufts else ["--no-repack"]


@contextlib.contextmanager
def server_process(
    command: list[str],
    port: int,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    any_health: bool = False,
) -> Iterator[str]:
    """Run a server process until the block ends; yields its URL once ``/health`` is ok
    (``any_health``: once it answers 200 at all, as vLLM's does, with an empty body)."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    # The server's own log is kept aside and shown if the block fails: why a server
    # stopped answering is in it.
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=log, env=None if env is None else dict(env)
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
                    health = httpx.get(f"{url}/health", timeout=2)
                    if any_health and health.status_code == 200:
                        break
                    if health.json().get("status") == "ok":
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{' '.join(command)} did not start")
                time.sleep(0.1)
            yield url
        except BaseException:
            log.seek(0)
            tail = log.read().decode("utf-8", "replace").splitlines()[-20:]
            print(f"-- the last lines of {command[0]}'s log:", *tail, sep="\n", file=sys.stderr)
            raise
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
