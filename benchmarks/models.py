"""Many models on one machine: loads, eviction, memory counted vs measured, two at once.

The default model under two names (two copies of its file in a temporary folder), each in
its own worker process (``Runtime(isolation="process")``), measured side by side in one run:

- **load_cold_s / load_warm_s**: the first load of a model (a new worker; its file read
  through the page cache as the machine has it), and a reload after an unload;
- **evict_reload_s**: a request for B with a budget that fits one model: A's eviction,
  B's load and its reply, against **reply_s**, the same request with B loaded;
- **memory**: what the budget counts (the GGUF estimate: weights, KV, prefix cache,
  overhead) against the worker's resident set after a long prompt in every slot
  (target: within 10%);
- **two at once**: each model's decode rate alone, then both streaming at once (each
  one's rate and the aggregate), with each worker's thread tuner choosing its threads
  (the default) and with ``--threads 1`` fixed, so the default's choice is measured.

Restore-from-disk against recompute of a long prefix is ``benchmarks/restore.py``.
Run: ``.venv/bin/python benchmarks/models.py [--rounds 2] [--json]``.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _harness
from tokenbelt import Runtime
from tokenbelt.models import default_model_path
from tokenbelt.runtime import MemoryUse

MIB = 1 << 20
_WORDS = ["the", "sea", "is", "wide", "and", "deep", "and", "blue", "under", "a", "grey", "sky"]


def _copies(folder: Path) -> list[str]:
    paths = []
    for name in ("model-a", "model-b"):
        target = folder / f"{name}.gguf"
        shutil.copyfile(default_model_path(), target)
        paths.append(str(target))
    return paths


def _timed(call: Any) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _reply(model: Any) -> None:
    model.complete(prompt="The sea is", max_tokens=8, temperature=0.0)


def loads(paths: list[str]) -> dict[str, float]:
    """Cold and warm load; eviction + reload against a reply from a loaded model."""
    one = 500 * MIB  # fits one model at slots 1, n_ctx 512
    with Runtime(isolation="process", slots=1, n_ctx=512, keep_alive=None, memory_budget=one) as rt:
        a = rt.load(paths[0], lazy=True)
        b = rt.load(paths[1], lazy=True)
        cold = _timed(a.ensure_loaded)
        a.keep_loaded_for(0)
        warm = _timed(a.ensure_loaded)
        a.set_keep_alive(None)
        reply = _timed(lambda: _reply(a))
        evict = _timed(lambda: _reply(b))  # A is evicted for it
        assert a.evictions == 1, "the budget should have evicted A"
    return {"load_cold_s": cold, "load_warm_s": warm, "reply_s": reply, "evict_reload_s": evict}


def memory(path: str, slots: int, n_ctx: int) -> dict[str, Any]:
    """The budget's count of one model against its worker's RSS with every slot full."""
    prompt = " ".join(_WORDS[i % len(_WORDS)] for i in range(int(n_ctx * 0.8)))
    with Runtime(isolation="process", slots=slots, n_ctx=n_ctx, keep_alive=None) as rt:
        model = rt.load(path)
        readers = [
            threading.Thread(
                target=lambda n=n: model.complete(prompt=f"{n} {prompt}", max_tokens=16)
            )
            for n in range(slots)
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        use = model.memory()
    assert isinstance(use, MemoryUse)
    assert use.measured is not None
    return {
        "slots": slots,
        "n_ctx": n_ctx,
        "estimated_mib": use.estimated / MIB,
        "measured_mib": use.measured / MIB,
        "weights_mib": use.weights / MIB,
        "kv_mib": (use.kv + use.cache) / MIB,
        "error": (use.estimated - use.measured) / use.measured,
    }


def _rates(models: list[Any], tokens: int) -> list[float]:
    """Each model's decode pieces/s while all of them decode."""
    times: list[list[float]] = [[] for _ in models]

    def read(n: int) -> None:
        for _ in models[n].stream(
            prompt="Tell me about the sea.", max_tokens=tokens, temperature=0.0, ignore_eos=True
        ):
            times[n].append(time.perf_counter())

    readers = [threading.Thread(target=read, args=(n,)) for n in range(len(models))]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    start, end = max(t[1] for t in times), min(t[-1] for t in times)
    return [sum(1 for at in t if start < at <= end) / (end - start) for t in times]


def together(paths: list[str], threads: int | None, tokens: int) -> dict[str, float]:
    with Runtime(isolation="process", slots=1, n_ctx=512, keep_alive=None, n_threads=threads) as rt:
        a, b = rt.load(paths[0]), rt.load(paths[1])
        _rates([a], 16)  # warm both (the tuner's first tries)
        _rates([b], 16)
        alone = _rates([a], tokens)[0]
        both = _rates([a, b], tokens)
    return {"alone": alone, "a": both[0], "b": both[1], "aggregate": sum(both)}


def main() -> None:
    p = _harness.parser(__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96, help="pieces per stream, two at once")
    p.add_argument("--slots", type=int, default=2, help="slots of the memory measure")
    p.add_argument("--n-ctx", type=int, default=1024, help="context of the memory measure")
    args = _harness.parse(p)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = _copies(Path(tmp))
        for _ in range(args.rounds):
            rounds.append(
                {
                    **loads(paths),
                    "memory": memory(paths[0], args.slots, args.n_ctx),
                    "tuned": together(paths, None, args.tokens),
                    "one_thread": together(paths, 1, args.tokens),
                }
            )

    def med(get: Any) -> float:
        return statistics.median(get(r) for r in rounds)

    result: dict[str, Any] = {
        "rounds": rounds,
        "load_cold_s": med(lambda r: r["load_cold_s"]),
        "load_warm_s": med(lambda r: r["load_warm_s"]),
        "reply_s": med(lambda r: r["reply_s"]),
        "evict_reload_s": med(lambda r: r["evict_reload_s"]),
        "memory_error": med(lambda r: abs(r["memory"]["error"])),
    }
    for mode in ("tuned", "one_thread"):
        for key in ("alone", "a", "b", "aggregate"):
            result[f"{mode}_{key}_tok_s"] = med(lambda r, m=mode, k=key: r[m][k])
    result["targets"] = {"memory counted within 10% of RSS": result["memory_error"] <= 0.10}
    _harness.emit(result, args.json, table)


def table(r: dict[str, Any]) -> None:
    mem = r["rounds"][-1]["memory"]
    rows = [
        ("load, cold (s)", f"{r['load_cold_s']:.2f}", ""),
        ("load, warm (s)", f"{r['load_warm_s']:.2f}", ""),
        ("reply, loaded (s)", f"{r['reply_s']:.2f}", ""),
        ("evict A + load B + reply (s)", f"{r['evict_reload_s']:.2f}", ""),
        ("memory estimated (MiB)", f"{mem['estimated_mib']:.0f}", ""),
        ("memory measured, RSS (MiB)", f"{mem['measured_mib']:.0f}", ""),
        ("memory error", f"{r['memory_error']:.1%}", "<= 10%"),
    ]
    for mode, label in (("tuned", "threads tuned"), ("one_thread", "1 thread each")):
        rows += [
            (f"{label}: A alone (tok/s)", f"{r[f'{mode}_alone_tok_s']:.1f}", ""),
            (f"{label}: A beside B (tok/s)", f"{r[f'{mode}_a_tok_s']:.1f}", ""),
            (f"{label}: B beside A (tok/s)", f"{r[f'{mode}_b_tok_s']:.1f}", ""),
            (f"{label}: both (tok/s)", f"{r[f'{mode}_aggregate_tok_s']:.1f}", ""),
        ]
    _harness.print_measures("Many models (default model under two names)", rows, 34)
    print()
    print(_harness.targets_line(r["targets"]))


if __name__ == "__main__":
    main()
