"""The price of the fault boundary: the engine in this process against a worker process.

The same SDK calls on the embedded default model, greedy, one slot, the prefix cache off
(every prompt computed), once with ``Runtime(isolation="thread")`` and once with
``Runtime(isolation="process")``:

- ``stream_ratio_process``: decode rate (first to last token, as the reader sees them)
  through the worker over in-process (target >= 0.97);
- ``ttft_overhead_process_ms``: median time to first token through the worker minus
  in-process (target <= 5 ms);
- ``cancel_release_process_p95_ms``: a stop at a random point in decode, and one a random
  moment into a ~1,000-token prefill; trace cancel-to-release, p95, through the worker
  (target: each within one decode step + 5 ms of in-process; ``step_ms`` is the step);
- ``restart_s``: the worker is killed (``SIGKILL``) mid-stream; from the kill to the first
  token of the next request (the restart and the load included);
- ``kill_release_ms``: a hung worker (``SIGSTOP``) and a stop; from the stop to the
  release, which comes when the worker is killed at the end of ``stop_grace`` (target:
  the grace + a small constant).

Each side runs in a process of its own (one OpenMP team per process, as in real use:
see ``benchmarks/batch.py``), rounds alternate thread/process, medians over ``--rounds``.

Run: ``.venv/bin/python benchmarks/isolation.py [--rounds N] [--tokens N] [--cancels N]
[--json]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import time
from typing import Any

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


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def stream_once(model: Model, tokens: int) -> tuple[float, float]:
    """(decode tok/s, time to first token in ms) of one greedy stream read to its end."""
    reply = model.complete(SEA, max_tokens=tokens, temperature=0.0)
    trace = reply.trace
    assert trace.decode_rate is not None
    assert trace.time_to_first_token is not None
    return trace.decode_rate, trace.time_to_first_token * 1000


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


def side(isolation: str, tokens: int, cancels: int, seed: int) -> dict[str, Any]:
    """One round of one side, in this process."""
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    with Runtime(
        isolation=isolation, keep_alive=None, n_ctx=2048, prefix_cache=False, stop_grace=GRACE_S
    ) as rt:
        model = rt.load(str(default_model_path()))
        stream_once(model, 16)  # warm up: page the weights in, let the thread tuner look
        rates, ttfts = zip(*(stream_once(model, tokens) for _ in range(2)), strict=True)
        out["tok_s"] = statistics.median(rates)
        out["ttft_ms"] = statistics.median(ttfts)
        out["decode"] = [cancel_in_decode(model, rng) for _ in range(cancels)]
        out["prefill"] = [cancel_in_prefill(model, rng) for _ in range(cancels)]
        if isolation == "process":
            out["restart_s"] = restart_once(model)
            out["kill_release_ms"] = kill_release_once(model)
    return out


def _side(isolation: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--side", isolation, "--tokens", str(args.tokens)]
    cmd += ["--cancels", str(args.cancels), "--seed", str(seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    for i in range(args.rounds):
        for isolation in SIDES if i % 2 == 0 else tuple(reversed(SIDES)):
            rounds[isolation].append(_side(isolation, args, seed=i))
    out: dict[str, Any] = {"tokens": args.tokens, "rounds": args.rounds, "stop_grace_s": GRACE_S}
    for isolation, results in rounds.items():
        out[f"tok_s_{isolation}"] = round(statistics.median(r["tok_s"] for r in results), 2)
        out[f"ttft_{isolation}_ms"] = round(statistics.median(r["ttft_ms"] for r in results), 2)
        out[f"cancel_release_{isolation}_p95_ms"] = {
            phase: round(_p95([v for r in results for v in r[phase]]), 2)
            for phase in ("decode", "prefill")
        }
    out["step_ms"] = round(1000 / out["tok_s_thread"], 2)
    out["stream_ratio_process"] = round(out["tok_s_process"] / out["tok_s_thread"], 3)
    out["ttft_overhead_process_ms"] = round(out["ttft_process_ms"] - out["ttft_thread_ms"], 2)
    out["restart_s"] = round(statistics.median(r["restart_s"] for r in rounds["process"]), 3)
    out["kill_release_ms"] = round(
        statistics.median(r["kill_release_ms"] for r in rounds["process"]), 1
    )
    return out


def print_table(r: dict[str, Any]) -> None:
    print(f"{'':>28} {'thread':>10} {'process':>10}")
    for label, key in (("decode tok/s", "tok_s_{}"), ("time to first token ms", "ttft_{}_ms")):
        print(f"{label:>28} {r[key.format('thread')]:>10} {r[key.format('process')]:>10}")
    for phase in ("decode", "prefill"):
        label = f"cancel->release p95 {phase} ms"
        thread = r["cancel_release_thread_p95_ms"][phase]
        process = r["cancel_release_process_p95_ms"][phase]
        print(f"{label:>28} {thread:>10} {process:>10}")
    for key in (
        "stream_ratio_process",
        "ttft_overhead_process_ms",
        "step_ms",
        "restart_s",
        "kill_release_ms",
        "stop_grace_s",
    ):
        print(f"{key:>28}: {r[key]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="thread/process pairs")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per timed stream")
    parser.add_argument("--cancels", type=int, default=10, help="stops per phase per round")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.tokens < 2 or args.cancels < 1:
        parser.error("--rounds and --cancels must be >= 1, --tokens >= 2")
    if args.side is not None:  # one side's round, in a process of its own
        print(json.dumps(side(args.side, args.tokens, args.cancels, args.seed)))
        return 0
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
