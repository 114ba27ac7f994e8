"""A lone stream with the thread tuner against the same stream at each fixed thread count.

Every side runs in a process of its own (two llama.cpp OpenMP teams in one process slow
each other down), loads the default model with ``--slots``/``--n-ctx`` in thread
isolation, streams ``--streams`` greedy requests of ``--tokens`` tokens (end tokens banned)
one after the other and reports its median time per token, first token to last. Sides
alternate in every round, their order turning; the medians over ``--rounds`` rounds are
compared. The fixed counts are the tuner's own candidates (all cores, one fewer, half).

``tuned_over_best`` is the tuned side's ms/token over the fastest fixed count's, target
<= 1.03: the tuner should cost a lone stream nothing it can measure. On 2026-12-04 (2
cores, quiet, ``--rounds 3``): 0.960 and 0.946 with the tuner's median rule, 1.026 with
the moving average it replaced (and 1.04-1.13 in three paired runs of that one before
this script): one slow step had put the stream on 1 thread for long runs.

Run: ``.venv/bin/python benchmarks/threads.py [--rounds N] [--streams N] [--tokens N]
[--json]``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

import _harness
from tokenbelt.engines import usable_cores

_SIDE = """
import statistics, sys, time
from tokenbelt import Runtime
from tokenbelt.models import default_model_path
threads, streams, tokens, slots, n_ctx = (int(a) for a in sys.argv[1:6])
fixed = {"n_threads": threads, "n_threads_batch": threads} if threads else {}
bias = {0: -100.0, 1: -100.0, 2: -100.0}
with Runtime(keep_alive=None, slots=slots, n_ctx=n_ctx, isolation="thread", **fixed) as rt:
    model = rt.load(str(default_model_path()))
    costs = []
    for i in range(streams):
        stamps = [time.perf_counter() for _ in model.stream(
            prompt=f"Once upon a time {i}", max_tokens=tokens, temperature=0.0,
            logit_bias=bias)]
        costs.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    print(statistics.median(costs))
"""


def side(threads: int, args: Any) -> float:
    """One side's median seconds per token, in a fresh process (0 threads: the tuner)."""
    argv = [str(threads), str(args.streams), str(args.tokens), str(args.slots), str(args.n_ctx)]
    done = subprocess.run(
        [sys.executable, "-c", _SIDE, *argv], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise SystemExit(f"side {threads or 'tuned'} failed: {done.stderr.strip()[-500:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = _harness.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every side")
    p.add_argument("--streams", type=int, default=4, help="streams per side and round")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--n-ctx", type=int, default=2048)
    args = _harness.parse(p)
    cores = usable_cores()
    # The counts the tuner picks from: all cores, one fewer, half.
    fixed = sorted({cores, max(1, cores - 1), max(1, cores // 2)}, reverse=True)
    names = ["tuned"] + [f"fixed_{t}" for t in fixed]
    counts = {name: 0 if name == "tuned" else int(name.split("_")[1]) for name in names}
    runs: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(side(counts[name], args) * 1000)
    ms = {name: round(statistics.median(values), 3) for name, values in runs.items()}
    best = min((n for n in names if n != "tuned"), key=ms.__getitem__)
    ratio = round(ms["tuned"] / ms[best], 3)
    result = {
        "cores": cores,
        "ms_per_token": ms,
        "runs_ms": {n: [round(v, 3) for v in values] for n, values in runs.items()},
        "best_fixed": best,
        "tuned_over_best": ratio,
        "targets": {"tuned_over_best": ratio <= 1.03},
    }
    _harness.emit(result, args.json, _table)


def _table(r: dict[str, Any]) -> None:
    print(f"a lone stream, ms per token (median of rounds), {r['cores']} cores")
    print()
    for name, value in r["ms_per_token"].items():
        print(f"{name:>10}: {value:7.3f}   rounds {r['runs_ms'][name]}")
    print()
    print(f"tuned over the best fixed count ({r['best_fixed']}): {r['tuned_over_best']}")
    print(_harness.targets_line(r["targets"]))


if __name__ == "__main__":
    main()
