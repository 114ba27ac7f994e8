"""The price of the fault boundary: the engine in this process against a worker process.

The same SDK calls on the embedded default model, greedy, one slot, the prefix cache off
(every prompt computed), through ``Runtime(isolation="thread")`` and through
``Runtime(isolation="process")``. Each side lives in a process of its own for the whole
run (one OpenMP team per process, as in real use: see ``benchmarks/batch.py``), and the
driver asks them in turn, so every measurement through the worker has an in-process twin
taken right before or right after it (the order alternates); slow drift in the machine's
load cancels out of the pair:

- ``stream_ratio_process``: decode rate (first to last token, as the reader sees them)
  through the worker over in-process, the median over pairs (target >= 0.97);
- ``ttft_overhead_process_ms``: time to first token through the worker minus in-process,
  the median over pairs (target <= 5 ms); ``admit_overhead_process_ms`` is the part of it
  from enqueue to admission, where the boundary's own cost shows without the prefill's
  spread;
- ``cancel_release_process_p95_ms``: a stop at a random point in decode, and one a random
  moment into a ~1,000-token prefill; trace cancel-to-release, p95, through the worker
  (target: each within one decode step + 5 ms of in-process; ``step_ms`` is the step);
- ``restart_s``: the worker is killed (``SIGKILL``) mid-stream; from the kill to the first
  token of the next request (the restart and the load included), median;
- ``kill_release_ms``: a hung worker (``SIGSTOP``) and a stop; from the stop to the
  release, which comes when the worker is killed at the end of ``stop_grace`` (target:
  the grace + a small constant), median.

Run: ``.venv/bin/python benchmarks/isolation.py [--trials N] [--tokens N] [--cancels N]
[--restarts N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import _harness
from tokenbelt import Model, Runtime
from tokenbelt.engines import Message, WorkerEngine
from tokenbelt.models import default_model_path

SEA: list[Message] = [{"role": "user", "content": "Tell me about the sea and its storms."}]
HELLO: list[Message] = [{"role": "user", "content": "Say hello."}]
_WORDS = ["the", "sea", "is", "wide", "and", "deep", "blue", "under", "a", "grey", "sky"]
LONG_PROMPT = " ".join(_WORDS[i % len(_WORDS)] for i in range(1000))
#: the stop grace of the hung-worker measurement
GRACE_S = 1.0
SIDES = ("thread", "process")
PHASES = ("decode", "prefill")
TARGET_RATIO = 0.97
TARGET_TTFT_MS = 5.0


# -- one side, in a process of its own -------------------------------------------------------


def stream_once(model: Model, tokens: int) -> dict[str, float]:
    """Decode tok/s, time to first token and enqueue-to-admission of one greedy stream."""
    reply = model.complete(SEA, max_tokens=tokens, temperature=0.0)
    trace = reply.trace
    assert trace.decode_rate is not None
    assert trace.time_to_first_token is not None
    assert trace.admitted is not None
    return {
        "tok_s": trace.decode_rate,
        "ttft_ms": trace.time_to_first_token * 1000,
        "admit_ms": (trace.admitted - trace.enqueued) * 1000,
    }


def cancel_in_decode(model: Model, rng: random.Random) -> float:
    stream = model.stream(SEA, max_tokens=400, temperature=0.0)
    pieces = iter(stream)
    for _ in range(rng.randrange(3, 12)):
        next(pieces)
    time.sleep(rng.random() * 0.03)
    stream.cancel()
    stream.wait_released(60)
    return (stream.trace.cancel_to_release or 0.0) * 1000


def cancel_in_prefill(model: Model, rng: random.Random) -> float:
    stream = model.stream(prompt=LONG_PROMPT, max_tokens=4, temperature=0.0)
    while stream.trace.admitted is None:
        time.sleep(0.0005)
    time.sleep(0.01 + rng.random() * 0.05)
    stream.cancel()
    stream.wait_released(60)
    return (stream.trace.cancel_to_release or 0.0) * 1000


def restart_once(model: Model) -> float:
    engine = model.engines[0]
    assert isinstance(engine, WorkerEngine)
    victim = model.stream(SEA, max_tokens=400, temperature=0.0)
    pieces = iter(victim)
    next(pieces)
    pid = engine.pid
    assert pid is not None
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    nxt = model.stream(HELLO, max_tokens=4, temperature=0.0)
    next(iter(nxt))
    first = nxt.trace.first_token or time.monotonic()
    nxt.read()
    victim.wait_released(60)
    return first - killed


def kill_release_once(model: Model) -> float:
    engine = model.engines[0]
    assert isinstance(engine, WorkerEngine)
    stream = model.stream(SEA, max_tokens=400, temperature=0.0)
    next(iter(stream))
    pid = engine.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    stream.cancel()
    stream.wait_released(60)
    model.complete(HELLO, max_tokens=2, temperature=0.0)  # the restarted worker serves
    return (stream.trace.cancel_to_release or 0.0) * 1000


def serve_side(isolation: str, seed: int) -> None:
    """Load once, then answer the driver's commands (one JSON line each) until EOF."""
    rng = random.Random(seed)
    with Runtime(
        isolation=isolation, keep_alive=None, n_ctx=2048, prefix_cache=False, stop_grace=GRACE_S
    ) as rt:
        model = rt.load(str(default_model_path()))
        for _ in range(3):  # warm up: the thread tuner tries each count once
            stream_once(model, 16)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            op, arg = json.loads(line)
            result: Any
            if op == "stream":
                result = stream_once(model, arg)
            elif op == "decode":
                result = cancel_in_decode(model, rng)
            elif op == "prefill":
                result = cancel_in_prefill(model, rng)
            elif op == "restart":
                result = restart_once(model)
            else:
                result = kill_release_once(model)
            print(json.dumps(result), flush=True)


# -- the driver ------------------------------------------------------------------------------


class Side:
    def __init__(self, isolation: str, seed: int) -> None:
        cmd = [sys.executable, __file__, "--side", isolation, "--seed", str(seed)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, op: str, arg: Any = None) -> Any:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([op, arg]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {op} side ended early (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def _pairs(sides: dict[str, Side], op: str, arg: Any, n: int) -> list[tuple[Any, Any]]:
    """``n`` (thread, process) results, taken back to back, the order alternating."""
    out = []
    for i in range(n):
        got = {}
        for isolation in SIDES if i % 2 == 0 else tuple(reversed(SIDES)):
            got[isolation] = sides[isolation].ask(op, arg)
        out.append((got["thread"], got["process"]))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    # One after the other: a side that loads while the other warms up would teach its
    # thread tuner what a busy machine looks like.
    sides: dict[str, Side] = {}
    try:
        for isolation in SIDES:
            side = sides[isolation] = Side(isolation, seed=1)
            assert side.proc.stdout is not None
            if not side.proc.stdout.readline():
                raise RuntimeError(f"the {isolation} side failed to load the model")
        streams = _pairs(sides, "stream", args.tokens, args.trials)
        cancels = {phase: _pairs(sides, phase, None, args.cancels) for phase in PHASES}
        restarts = [sides["process"].ask("restart") for _ in range(args.restarts)]
        kills = [sides["process"].ask("kill_release") for _ in range(args.restarts)]
    finally:
        for side in sides.values():
            side.close()
    out: dict[str, Any] = {
        "tokens": args.tokens,
        "trials": args.trials,
        "cancels": args.cancels,
        "stop_grace_s": GRACE_S,
    }
    for i, isolation in enumerate(SIDES):
        for key in ("tok_s", "ttft_ms", "admit_ms"):
            name = f"{key[:-3]}_{isolation}_ms" if key.endswith("_ms") else f"{key}_{isolation}"
            out[name] = round(statistics.median(pair[i][key] for pair in streams), 2)
        out[f"cancel_release_{isolation}_p95_ms"] = {
            phase: round(_harness.percentile([pair[i] for pair in pairs], 0.95), 2)
            for phase, pairs in cancels.items()
        }
    out["step_ms"] = round(1000 / out["tok_s_thread"], 2)
    out["stream_ratio_process"] = round(
        statistics.median(p["tok_s"] / t["tok_s"] for t, p in streams), 3
    )
    for key in ("ttft", "admit"):
        out[f"{key}_overhead_process_ms"] = round(
            statistics.median(p[f"{key}_ms"] - t[f"{key}_ms"] for t, p in streams), 2
        )
    out["restart_s"] = round(statistics.median(restarts), 3)
    out["kill_release_ms"] = round(statistics.median(kills), 1)
    out["targets_met"] = {
        "stream_ratio_process": out["stream_ratio_process"] >= TARGET_RATIO,
        "ttft_overhead_process_ms": out["ttft_overhead_process_ms"] <= TARGET_TTFT_MS,
        "cancel_release_process_p95_ms": all(
            out["cancel_release_process_p95_ms"][phase]
            <= out["cancel_release_thread_p95_ms"][phase] + out["step_ms"] + 5
            for phase in PHASES
        ),
    }
    return out


def print_table(r: dict[str, Any]) -> None:
    print(f"{'':>28} {'thread':>10} {'process':>10}")
    for label, key in (
        ("decode tok/s", "tok_s_{}"),
        ("time to first token ms", "ttft_{}_ms"),
        ("enqueue->admitted ms", "admit_{}_ms"),
    ):
        print(f"{label:>28} {r[key.format('thread')]:>10} {r[key.format('process')]:>10}")
    for phase in PHASES:
        label = f"cancel->release p95 {phase} ms"
        thread = r["cancel_release_thread_p95_ms"][phase]
        process = r["cancel_release_process_p95_ms"][phase]
        print(f"{label:>28} {thread:>10} {process:>10}")
    keys = ("stream_ratio_process", "ttft_overhead_process_ms", "admit_overhead_process_ms")
    _harness.print_keys(r, (*keys, "step_ms", "restart_s", "kill_release_ms", "stop_grace_s"), 28)
    print(_harness.targets_line(r["targets_met"]))


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--trials", type=int, default=15, help="thread/process stream pairs")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per timed stream")
    parser.add_argument("--cancels", type=int, default=20, help="stop pairs per phase")
    parser.add_argument("--restarts", type=int, default=3, help="kills and hung workers")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = _harness.parse(parser, argv)
    if args.side is not None:  # one side, in a process of its own
        serve_side(args.side, args.seed)
        return 0
    if min(args.trials, args.cancels, args.restarts) < 1 or args.tokens < 2:
        parser.error("--trials, --cancels and --restarts must be >= 1, --tokens >= 2")
    _harness.emit(run(args), args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
