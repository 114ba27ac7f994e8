"""A soak of ``tokenbelt serve``: mixed load over every dialect, resets, and chaos, reconciled.

Starts ``tokenbelt serve`` on 127.0.0.1 (the default model in its worker process, the
default of ``serve``), or drives ``--url``. ``--clients`` threads send ``--requests``
requests between them, cycling through the OpenAI, Ollama, Anthropic and Responses
routes, streamed and not (a few streams are abandoned after two events, a few carry a
total timeout shorter than their reply); ``--resets`` more are non-streamed chat requests
whose connection is reset (RST) 0.05-4 s (``--reset-within``) after sending. With
``--chaos`` the worker is killed ``--kills`` times (``SIGKILL``) and frozen once for
``--freeze`` seconds (``SIGSTOP``, then ``SIGCONT``) during the load.

Every request carries its own ``x-request-id``; once it ends, its client reads its trace
(``GET /v1/requests/{id}``, at once: the server keeps its recent requests only). What is reconciled:

- ``mismatches``: the end reason the client saw (each dialect's ``tokenbelt.end_reason``)
  differs from the trace's;
- ``lost``: a request the server has no trace of; ``hung``: a request whose answer did
  not come within ``--timeout``; ``unreleased``: a trace with no release 10 s after;
- ``no_terminal``: a stream that ended without its dialect's terminal event (OpenAI's
  ``[DONE]``, Ollama's ``done: true``, Anthropic's ``message_stop``, the Responses API's
  ``response.completed``/``incomplete``/``failed``), abandoned ones aside;
- ``queued_failed``: a request never admitted that ended ``runtime_error`` (a crash
  must cost only what was running);
- ``metrics_mismatch`` / ``log_mismatch``: ``tokenbelt_requests_total`` (its increase)
  and the request log lines, per end reason, against the traces;
- ``restarts`` and ``unasked_kills`` (restarts beyond the injected kills);
- ``stop_to_release_ms``: p50/p95/p99/max over every stopped request's trace;
- ``growth``: the server's RSS (MB), threads and open fds, after a warm-up and at the end.

Loopback only; bounded by ``--requests`` and ``--seconds``. Figures from a busy machine
say little: take them on a quiet one.

Run: ``.venv/bin/python benchmarks/soak.py [--requests N] [--clients N] [--resets N]
[--reset-within S] [--max-tokens N]
[--chaos] [--kills N] [--freeze S] [--chaos-gap S] [--seconds S] [--url URL] [--json]``.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

import _harness

SEA = [{"role": "user", "content": "Tell me about the sea."}]
#: (dialect, streamed): the request kinds, cycled
KINDS = [(d, s) for d in ("openai", "ollama", "anthropic", "responses") for s in (True, False)]
#: Anthropic's and the Responses API's terminal events
TERMINAL = {"message_stop", "response.completed", "response.incomplete", "response.failed"}


@dataclass
class Seen:
    """One request as its client saw it."""

    request_id: str
    kind: str
    reason: str | None = None  # the end reason the answer carried
    terminal: bool = True  # a stream ended with its dialect's terminal event
    abandoned: bool = False  # the client went away on purpose (reset, early close)
    hung: bool = False
    trace: dict[str, Any] | None = None


@dataclass
class Run:
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, s: Seen) -> None:
        with self.lock:
            self.seen.append(s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reason_of(body: Any) -> str | None:
    """``tokenbelt.end_reason`` wherever the dialect puts it."""
    if not isinstance(body, dict):
        return None
    for holder in (body, body.get("response"), body.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("tokenbelt"), dict):
            reason = holder["tokenbelt"].get("end_reason")
            if reason is not None:
                return str(reason)
    return None


def _request(dialect: str, streamed: bool, model: str, tokens: int, extra: dict[str, Any]):
    if dialect == "openai":
        body = {"model": model, "messages": SEA, "max_tokens": tokens, "stream": streamed}
        return "/v1/chat/completions", {**body, **extra}
    if dialect == "ollama":
        body = {"model": model, "messages": SEA, "stream": streamed}
        return "/api/chat", {**body, "options": {"num_predict": tokens}, **extra}
    if dialect == "anthropic":
        body = {"model": model, "messages": SEA, "max_tokens": tokens, "stream": streamed}
        return "/v1/messages", {**body, **extra}
    body = {"model": model, "input": "Tell me about the sea.", "stream": streamed}
    return "/v1/responses", {**body, "max_output_tokens": tokens, **extra}


def _stream(client: httpx.Client, dialect: str, path: str, body: dict, s: Seen, abandon: bool):
    events = 0
    with client.stream("POST", path, json=body, headers={"x-request-id": s.request_id}) as r:
        if r.status_code != 200:
            s.reason = _reason_of(json.loads(r.read() or b"{}")) or f"http_{r.status_code}"
            return
        done = False
        for line in r.iter_lines():
            if not line:
                continue
            events += 1
            if abandon and events == 2:
                s.abandoned = True
                return
            if dialect == "ollama":
                obj = json.loads(line)
                s.reason = _reason_of(obj) or s.reason
                done = done or obj.get("done") is True
            elif line.startswith("event: "):
                done = done or line.removeprefix("event: ") in TERMINAL
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    continue
                s.reason = _reason_of(json.loads(data)) or s.reason
        s.terminal = done


def one(
    client: httpx.Client,
    base: str,
    model: str,
    i: int,
    rng: random.Random,
    run: Run,
    max_tokens: int,
) -> None:
    dialect, streamed = KINDS[i % len(KINDS)]
    s = Seen(f"soak-{os.getpid()}-{i}", f"{dialect}{'-stream' if streamed else ''}")
    extra: dict[str, Any] = {}
    if rng.random() < 0.1:  # a deadline shorter than the reply
        extra["tokenbelt"] = {"total_timeout": 0.3}
    path, body = _request(
        dialect, streamed, model, rng.randint(min(4, max_tokens), max_tokens), extra
    )
    try:
        if streamed:
            _stream(client, dialect, base + path, body, s, abandon=rng.random() < 0.1)
        else:
            r = client.post(base + path, json=body, headers={"x-request-id": s.request_id})
            s.reason = "rejected" if r.status_code == 429 else _reason_of(r.json())
    except httpx.TimeoutException:
        s.hung = True
    except httpx.HTTPError:
        s.abandoned = True
    fetch_trace(client, base, s)
    run.add(s)


def reset(base: str, model: str, i: int, rng: random.Random, run: Run, within: float) -> None:
    """A non-streamed request whose connection is reset 0.05 to ``within`` s after it was
    sent."""
    s = Seen(f"reset-{os.getpid()}-{i}", "reset", abandoned=True)
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "messages": SEA, "max_tokens": 200}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nx-request-id: {s.request_id}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(rng.uniform(0.05, within))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with httpx.Client() as client:
        fetch_trace(client, base, s)
    run.add(s)


def fetch_trace(client: httpx.Client, base: str, s: Seen) -> None:
    """The request's trace once released (10 s at most), read as soon as it ended: the
    server keeps only its recent requests."""
    deadline = time.monotonic() + 10.0
    while True:
        r = client.get(f"{base}/v1/requests/{s.request_id}", timeout=10.0)
        s.trace = r.json() if r.status_code == 200 else None
        released = s.trace is not None and s.trace["timeline_ms"]["released"] is not None
        if released or time.monotonic() > deadline or (s.trace is None and s.hung):
            return
        time.sleep(0.05)


def _worker_pid(base: str) -> int | None:
    try:
        health = httpx.get(f"{base}/health", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    for w in (health.get("workers") or {}).values():
        if w.get("pid"):
            return int(w["pid"])
    return None


def chaos(base: str, kills: int, freeze_s: float, gap: float, stop: threading.Event) -> dict:
    """``kills`` SIGKILLs and one SIGSTOP of the worker, ``gap`` seconds apart, until the
    load ends (``stop``)."""
    # A freeze longer than the stop grace with a stop pending gets the worker killed, as
    # it should: counted apart (``freeze_kills``), not as a kill no one asked for.
    done = {"kills": 0, "freezes": 0, "freeze_kills": 0}
    plan = ["kill"] * kills + (["freeze"] if freeze_s > 0 else [])
    random.Random(7).shuffle(plan)
    for what in plan:
        if stop.wait(gap):
            break
        pid = _worker_pid(base)
        if pid is None:
            continue
        if what == "kill":
            os.kill(pid, signal.SIGKILL)
            done["kills"] += 1
        else:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(freeze_s)
            done["freezes"] += 1
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                done["freeze_kills"] += 1
    return done


def _metric_totals(base: str) -> tuple[collections.Counter[str], float]:
    text = httpx.get(f"{base}/metrics", timeout=10.0).text
    totals: collections.Counter[str] = collections.Counter()
    restarts = 0.0
    for line in text.splitlines():
        if line.startswith("tokenbelt_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('end_reason="', 1)[1].split('"', 1)[0]
            totals[reason] += int(float(value))
        elif line.startswith("tokenbelt_worker_restarts_total"):
            restarts += float(line.rsplit(" ", 1)[1])
    return totals, restarts


def _growth(pid: int | None) -> dict[str, float] | None:
    if pid is None:
        return None
    p = psutil.Process(pid)
    return {"rss_mb": p.memory_info().rss / 2**20, "threads": p.num_threads(), "fds": p.num_fds()}


def _serve(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [sys.executable, "-m", "tokenbelt", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--slots", str(args.slots), "--queue-size", str(args.queue)]
    command += ["--log-level", "info", "--keep-alive", "0"]
    out = log.open("wb")
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"tokenbelt serve exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=2.0).json().get("status") == "ok":
                return process, base
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("tokenbelt serve was not ready within 120 s")


def soak(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tokenbelt-soak-"))
    log = tmp / "serve.log"
    process, base = (None, args.url) if args.url else _serve(args, log)
    try:
        model = next(iter(httpx.get(f"{base}/health", timeout=10).json()["models"]))
        server_pid = process.pid if process else None
        with httpx.Client(timeout=args.timeout) as warm:  # a warm-up before the baseline
            warm.post(
                f"{base}/v1/chat/completions", json=_request("openai", False, model, 4, {})[1]
            )
        before = _growth(server_pid)
        totals_before, restarts_before = _metric_totals(base)
        run = Run()
        counter = iter(range(args.requests))
        more = itertools.count(args.requests)
        lock = threading.Lock()
        started = time.monotonic()
        stop = threading.Event()
        # With --chaos the load goes on past --requests until every event was injected
        # (bounded by --seconds): a fast run must not end before its first kill.
        chaos_done = threading.Event()
        if not args.chaos:
            chaos_done.set()

        def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(timeout=args.timeout) as client:
                while time.monotonic() - started < args.seconds:
                    with lock:
                        i = next(counter, None)
                        if i is None and not chaos_done.is_set():
                            i = next(more)
                    if i is None:
                        return
                    one(client, base, model, i, rng, run, args.max_tokens)

        def reset_loop() -> None:
            rng = random.Random(99)
            for i in range(args.resets):
                if time.monotonic() - started >= args.seconds:
                    return
                reset(base, model, i, rng, run, args.reset_within)

        threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(args.clients)]
        threads.append(threading.Thread(target=reset_loop))
        injected: dict[str, int] = {}
        if args.chaos:
            gap = args.chaos_gap
            threads.append(
                threading.Thread(
                    target=lambda: (
                        injected.update(chaos(base, args.kills, args.freeze, gap, stop)),
                        chaos_done.set(),
                    )
                )
            )
        for t in threads:
            t.start()
        for t in threads[: args.clients + 1]:
            t.join()
        stop.set()
        for t in threads[args.clients + 1 :]:
            t.join()
        elapsed = time.monotonic() - started
        totals_after, restarts_after = _metric_totals(base)
        after = _growth(server_pid)
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
    return reconcile(run, totals_after - totals_before, restarts_after - restarts_before,
                     injected, before, after, log if process else None, elapsed)  # fmt: skip


def reconcile(
    run: Run,
    metric_delta: collections.Counter[str],
    restarts: float,
    injected: dict[str, int],
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    log: Path | None,
    elapsed: float,
) -> dict[str, Any]:
    traced = [s for s in run.seen if s.trace is not None]
    by_reason = collections.Counter(str(s.trace["end_reason"]) for s in traced)  # type: ignore[index]
    stops = [
        s.trace["cancel_to_release_ms"]  # type: ignore[index]
        for s in traced
        if s.trace["cancel_to_release_ms"] is not None  # type: ignore[index]
    ]
    mismatches = [
        (s.request_id, s.reason, s.trace["end_reason"])  # type: ignore[index]
        for s in traced
        if s.reason is not None and not s.abandoned and s.reason != s.trace["end_reason"]  # type: ignore[index]
    ]
    result: dict[str, Any] = {
        "requests": len(run.seen),
        "seconds": round(elapsed, 1),
        "by_kind": dict(collections.Counter(s.kind for s in run.seen)),
        "end_reasons": dict(by_reason),
        "mismatches": len(mismatches),
        "mismatch_examples": mismatches[:5],
        "lost": sum(1 for s in run.seen if s.trace is None and not s.hung),
        "hung": sum(1 for s in run.seen if s.hung),
        "unreleased": sum(1 for s in traced if s.trace["timeline_ms"]["released"] is None),  # type: ignore[index]
        "no_terminal": sum(1 for s in run.seen if not s.terminal and not s.abandoned),
        "queued_failed": sum(
            1
            for s in traced
            if s.trace["end_reason"] == "runtime_error"  # type: ignore[index]
            and s.trace["timeline_ms"]["admitted"] is None  # type: ignore[index]
        ),
        "restarts": int(restarts),
        "injected": injected,
        "unasked_kills": max(
            0, int(restarts) - injected.get("kills", 0) - injected.get("freeze_kills", 0)
        ),
        "metrics_mismatch": dict(metric_delta) != dict(by_reason),
        "stop_to_release_ms": {
            "n": len(stops),
            **(
                {
                    "p50": round(_harness.percentile(stops, 0.50), 1),
                    "p95": round(_harness.percentile(stops, 0.95), 1),
                    "p99": round(_harness.percentile(stops, 0.99), 1),
                    "max": round(max(stops), 1),
                }
                if stops
                else {}
            ),
        },
        "growth": None
        if before is None or after is None
        else {k: round(after[k] - before[k], 1) for k in before},
    }
    if log is not None:
        logged: collections.Counter[str] = collections.Counter()
        ids = {s.request_id for s in run.seen}
        for line in log.read_text(errors="replace").splitlines():
            if '"event": "request"' in line:
                record = json.loads(line[line.index("{") :])
                if record["request_id"] in ids:
                    logged[record["end_reason"]] += 1
        result["log_mismatch"] = dict(logged) != dict(by_reason)
        result["log_not_honoured"] = log.read_text(errors="replace").count("not honoured")
    return result


def table(result: dict[str, Any]) -> None:
    keys = [k for k in result if k not in ("by_kind", "end_reasons", "mismatch_examples")]
    print("tokenbelt soak")
    print()
    _harness.print_keys(result, keys, 20)
    print(f"{'end_reasons':>20}: {result['end_reasons']}")


def main(argv: list[str] | None = None) -> None:
    p = _harness.parser(__doc__)
    p.add_argument("--requests", type=int, default=2000, help="mixed requests (default 2000)")
    p.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    p.add_argument("--resets", type=int, default=100, help="non-stream resets (default 100)")
    p.add_argument(
        "--reset-within", type=float, default=4.0, help="a reset comes 0.05 to this many s in"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="longest reply (default 32)")
    p.add_argument("--chaos", action="store_true", help="kill and freeze the worker meanwhile")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs with --chaos (default 5)")
    p.add_argument("--freeze", type=float, default=10.0, help="SIGSTOP seconds (default 10)")
    p.add_argument(
        "--chaos-gap", type=float, default=8.0, help="seconds between chaos events (default 8)"
    )
    p.add_argument("--seconds", type=float, default=1800.0, help="time bound (default 1800)")
    p.add_argument("--timeout", type=float, default=120.0, help="a request's client timeout")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--queue", type=int, default=8, help="--queue-size of the server")
    p.add_argument("--url", help="an already running server (loopback) instead of a new one")
    args = _harness.parse(p, argv)
    _harness.emit(soak(args), args.json, table)


if __name__ == "__main__":
    main()
