"""KV cache type: the memory q8_0 saves over f16, and the decode speed it costs.

Each type loads the default model through the SDK (``Runtime(kv_type=...)``, thread
isolation) in a process of its own, alternating which goes first each round, and reports:

- **kv_mib**: the KV buffer llama.cpp allocated (its own log line), for ``--slots``
  sequences of ``--n-ctx`` tokens plus the prefix cache's cells;
- **rss_mib**: the process's resident memory once loaded and after the run (psutil);
- **tok_s_1 / tok_s_4**: streamed decode pieces/s (while all decode) with 1 and 4
  concurrent streams, each with a prompt of about ``--prompt`` tokens (attention reads
  the cache, so a longer context is where the type shows), greedy, ``--tokens`` each.

No target: the choice is the user's (``--kv-type``); this says what it costs here.
Run: ``.venv/bin/python benchmarks/kv.py [--rounds 2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

import _harness
from tokenbelt import Runtime
from tokenbelt.engines import KV_TYPES
from tokenbelt.models import default_model_path

_WORDS = ["the", "sea", "is", "wide", "and", "deep", "and", "blue", "under", "a", "grey", "sky"]


def _rate(model: Any, streams: int, prompt: int, tokens: int) -> float:
    """Aggregate decode pieces/s while all ``streams`` decode (after the last one's first
    piece and before the first one's end), so prefill is not counted."""
    text = " ".join(_WORDS[i % len(_WORDS)] for i in range(prompt))
    times: list[list[float]] = [[] for _ in range(streams)]

    def read(n: int) -> None:
        messages = [{"role": "user", "content": f"{n}: {text}. Go on."}]
        for _ in model.stream(messages, max_tokens=tokens, temperature=0.0):
            times[n].append(time.perf_counter())

    readers = [threading.Thread(target=read, args=(n,)) for n in range(streams)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    inside = sum(1 for t in times for at in t if start < at <= end)
    return inside / (end - start)


def side(kv_type: str, slots: int, n_ctx: int, prompt: int, tokens: int) -> dict[str, Any]:
    """One type's measures, in this process (run by ``run`` in a fresh one)."""
    sizes: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "KV buffer size" in record.getMessage():
                sizes.append(record.getMessage())

    native = logging.getLogger("tokenbelt.engines.llama.native")
    native.setLevel(logging.DEBUG)
    native.addHandler(Catch())
    me = psutil.Process()
    with Runtime(slots=slots, n_ctx=n_ctx, keep_alive=None, kv_type=kv_type) as rt:
        model = rt.load(str(default_model_path()))
        loaded = me.memory_info().rss
        _rate(model, 1, 16, 8)  # warm up
        one = _rate(model, 1, prompt, tokens)
        four = _rate(model, min(4, slots), prompt, tokens)
        after = me.memory_info().rss
    kv = float(sizes[-1].split("=")[1].split()[0]) if sizes else float("nan")
    mib = 1024 * 1024
    return {
        "kv_mib": kv,
        "rss_loaded_mib": round(loaded / mib, 1),
        "rss_after_mib": round(after / mib, 1),
        "tok_s_1": round(one, 1),
        "tok_s_4": round(four, 1),
    }


def run(args: Any) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in KV_TYPES}
    for i in range(args.rounds):
        order = list(KV_TYPES) if i % 2 == 0 else list(reversed(KV_TYPES))
        for kv_type in order:
            cmd = [sys.executable, __file__, "--side", kv_type]
            cmd += ["--slots", str(args.slots), "--n-ctx", str(args.n_ctx)]
            cmd += ["--prompt", str(args.prompt), "--tokens", str(args.tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rounds[kv_type].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out: dict[str, Any] = {"rounds": args.rounds, "slots": args.slots, "n_ctx": args.n_ctx}
    out.update(prompt=args.prompt, tokens=args.tokens)
    for kv_type, results in rounds.items():
        for key in results[0]:
            out[f"{kv_type}_{key}"] = round(statistics.median(r[key] for r in results), 1)
    for key in ("kv_mib", "rss_after_mib", "tok_s_1", "tok_s_4"):
        out[f"q8_0_over_f16_{key}"] = round(out[f"q8_0_{key}"] / out[f"f16_{key}"], 3)
    return out


def print_table(r: dict[str, Any]) -> None:
    print(f"KV cache type, {r['slots']} slots x {r['n_ctx']} tokens, prompt ~{r['prompt']}")
    print()
    print(f"{'measure':<16} {'f16':>10} {'q8_0':>10} {'q8_0/f16':>9}")
    for key in ("kv_mib", "rss_loaded_mib", "rss_after_mib", "tok_s_1", "tok_s_4"):
        ratio = r.get(f"q8_0_over_f16_{key}", "")
        print(f"{key:<16} {r[f'f16_{key}']:>10} {r[f'q8_0_{key}']:>10} {ratio:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="f16/q8_0 pairs")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=1000, help="words in each prompt")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--side", choices=KV_TYPES, help=argparse.SUPPRESS)
    args = _harness.parse(parser, argv)
    if args.side is not None:
        print(json.dumps(side(args.side, args.slots, args.n_ctx, args.prompt, args.tokens)))
        return 0
    if args.rounds < 1 or args.tokens < 2 or args.prompt < 1:
        parser.error("--rounds and --prompt must be >= 1, --tokens >= 2")
    _harness.emit(run(args), args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
