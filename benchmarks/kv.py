"""KV cache type: the memory each saves, the speed each costs, and whether greedy text
depends on what shares a step.

Each type (``KV_TYPES``: f16, q8_0) loads the default model through the SDK
(``Runtime(kv_type=...)``, thread isolation, both thread counts pinned to every usable
core) in a process of its own, the order rotating each round, and reports:

- **kv_mib**: the KV buffer llama.cpp allocated (its own log line), for ``--slots``
  sequences of ``--n-ctx`` tokens plus the prefix cache's cells;
- **rss_mib**: the process's resident memory once loaded and after the run (psutil);
- **tok_s_1 / tok_s_4**: streamed decode pieces/s (while all decode) with 1 and 4
  concurrent streams, each with a prompt of about ``--prompt`` tokens (attention reads
  the cache, so a longer context is where the type shows), greedy, ``--tokens`` each;
- **prefill_tok_s**: prompt tokens/s of that prompt alone (from its trace: enqueued
  to first token), prefix cache off;
- **same_text**: whether an edit prompt's greedy reply (200 tokens or ``--tokens``) is the
  same text alone, drafted and beside three other streams: with q8_0 llama.cpp's CPU
  attention computes each row with one kernel whatever its step holds; with f16 a lone
  row over 512 or more cells is split across the threads and 64 rows or more take a
  tiled kernel, so a near tie may go either way.

No target: the choice is the user's (``--kv-type``); this says what each costs here.
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
from draft import EDIT
from tokenbelt import Runtime
from tokenbelt.engines import KV_TYPES, usable_cores
from tokenbelt.models import default_model_path

#: most tokens a rate's stream may make (stopped once measured; room in a 2048 window)
_RATE_MAX_TOKENS = 800
_WORDS = ["the", "sea", "is", "wide", "and", "deep", "and", "blue", "under", "a", "grey", "sky"]


def _rate(model: Any, streams: int, prompt: int, tokens: int) -> float:
    """Aggregate decode pieces/s while all ``streams`` decode: from the last one's first
    piece until each has made ``tokens`` more (then all are stopped), so no prefill is
    counted however long the prompts take to read in."""
    text = " ".join(_WORDS[i % len(_WORDS)] for i in range(prompt))
    times: list[list[float]] = [[] for _ in range(streams)]
    handles = [
        model.stream(
            [{"role": "user", "content": f"{n}: {text}. Go on."}],
            max_tokens=_RATE_MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
        )
        for n in range(streams)
    ]

    def read(n: int) -> None:
        for _ in handles[n]:
            times[n].append(time.perf_counter())

    readers = [threading.Thread(target=read, args=(n,)) for n in range(streams)]
    for t in readers:
        t.start()
    while not all(times) and any(t.is_alive() for t in readers):
        time.sleep(0.005)
    start = max(t[0] for t in times)

    def made(t: list[float]) -> int:
        return sum(1 for at in t if at > start)

    while min(made(t) for t in times) < tokens and all(t.is_alive() for t in readers):
        time.sleep(0.005)
    end = time.perf_counter()
    for h in handles:
        h.cancel()
    for t in readers:
        t.join()
    inside = sum(1 for t in times for at in t if start < at <= end)
    return inside / (end - start)


def _prefill(model: Any, prompt: int) -> float:
    """Prompt tokens/s of one long prompt, alone (enqueued to first token)."""
    text = " ".join(_WORDS[(i * 7) % len(_WORDS)] for i in range(prompt))
    reply = model.complete([{"role": "user", "content": f"Once more: {text}"}], max_tokens=1)
    t = reply.trace
    return float(t.prompt_tokens / (t.first_token - t.enqueued))


def _same_text(model: Any, tokens: int) -> bool:
    """Whether an edit prompt's greedy reply (``draft.EDIT``, ~480 tokens, so its cells
    pass 512) is the same text alone, with prompt-lookup drafting, and beside three other
    streams."""
    asked: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.0}
    alone = model.complete(EDIT, draft="off", **asked).text
    drafted = model.complete(EDIT, draft="lookup", **asked).text
    others = [
        model.stream([{"role": "user", "content": f"Story {n} about the sea."}], **asked)
        for n in range(3)
    ]
    readers = [threading.Thread(target=s.read) for s in others]
    for t in readers:
        t.start()
    batched = model.stream(EDIT, draft="off", **asked).read().text
    for t in readers:
        t.join()
    return alone == drafted == batched


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
    cores = usable_cores()
    with Runtime(
        slots=slots,
        n_ctx=n_ctx,
        keep_alive=None,
        kv_type=kv_type,
        prefix_cache=False,
        n_threads=cores,
        n_threads_batch=cores,
    ) as rt:
        model = rt.load(str(default_model_path()))
        loaded = me.memory_info().rss
        _rate(model, 1, 16, 8)  # warm up
        one = _rate(model, 1, prompt, tokens)
        four = _rate(model, min(4, slots), prompt, tokens)
        prefill = statistics.median(_prefill(model, prompt) for _ in range(3))
        same = _same_text(model, max(tokens, 200))
        after = me.memory_info().rss
    kv = float(sizes[-1].split("=")[1].split()[0]) if sizes else float("nan")
    mib = 1024 * 1024
    return {
        "kv_mib": kv,
        "rss_loaded_mib": round(loaded / mib, 1),
        "rss_after_mib": round(after / mib, 1),
        "tok_s_1": round(one, 1),
        "tok_s_4": round(four, 1),
        "prefill_tok_s": round(prefill, 1),
        "same_text": same,
    }


def run(args: Any) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in KV_TYPES}
    types = list(KV_TYPES)
    for i in range(args.rounds):
        order = types[i % len(types) :] + types[: i % len(types)]
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
            if key == "same_text":
                out[f"{kv_type}_{key}"] = all(r[key] for r in results)
            else:
                out[f"{kv_type}_{key}"] = round(statistics.median(r[key] for r in results), 1)
    for kv_type in types[1:]:
        for key in RATIOS:
            out[f"{kv_type}_over_f16_{key}"] = round(out[f"{kv_type}_{key}"] / out[f"f16_{key}"], 3)
    return out


#: the measures given as a ratio to f16's
RATIOS = ("kv_mib", "rss_after_mib", "tok_s_1", "tok_s_4", "prefill_tok_s")


def print_table(r: dict[str, Any]) -> None:
    print(f"KV cache type, {r['slots']} slots x {r['n_ctx']} tokens, prompt ~{r['prompt']}")
    print()
    types = list(KV_TYPES)
    print(
        f"{'measure':<20}"
        + "".join(f"{t:>11}" for t in types)
        + "".join(f"{t + '/f16':>15}" for t in types[1:])
    )
    keys = ("kv_mib", "rss_loaded_mib", "rss_after_mib", "tok_s_1", "tok_s_4", "prefill_tok_s")
    for key in (*keys, "same_text"):
        ratios = "".join(f"{r.get(f'{t}_over_f16_{key}', ''):>15}" for t in types[1:])
        print(f"{key:<20}" + "".join(f"{r[f'{t}_{key}']!s:>11}" for t in types) + ratios)


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every type")
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
