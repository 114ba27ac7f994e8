"""Prefix cache restored from disk: the next turn's first token after a reload, vs recompute.

For each prefix length (``--prefixes``, default 500, 1,500 and 3,000 tokens): a batch
engine on the default model answers a long system text and a question, and closes,
which saves its prefix cache to a fresh directory (``prefix_cache_dir``). Then:

- **restored_s**: a new engine on that directory reads the cache back while it loads
  (**restore_s**, timed around that step alone) and answers the next turn (the same
  prompt, an answer and a new question); restored_s is restore_s plus that turn's time
  to first token (**ttft_restored_s**): what the next turn waits for beyond the load;
- **recompute_s**: an engine with no cache answers the same next turn, computing its
  whole prompt: its time to first token;
- **ratio**: restored_s / recompute_s (target: at most 0.25);
- **bytes_per_token**: bytes on disk per saved token.

Medians over ``--rounds``; greedy, one token per answer. Every engine in this process,
one at a time. Run: ``.venv/bin/python benchmarks/restore.py [--rounds 1] [--json]``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness
from tokenbelt import GenerationRequest, SamplingParams
from tokenbelt.belt import Belt
from tokenbelt.engines import BatchEngine, Message
from tokenbelt.models import default_model_path

#: at most this ratio of restored to recomputed first-token time
TARGET_RATIO = 0.25
_WORDS = ["the", "sea", "is", "wide", "and", "deep", "blue", "under", "a", "grey", "sky"]
_QUESTION = "What colour is the sea in this text?"


class _Timed(BatchEngine):
    """A batch engine that times its restore step (the loop's first job)."""

    restore_s = 0.0

    def _restore(self) -> None:
        started = time.perf_counter()
        super()._restore()
        self.restore_s = time.perf_counter() - started


def _conversation(tokens: int, next_turn: bool) -> list[Message]:
    # About one token per word on the default model, less the template's.
    text = " ".join(_WORDS[i % len(_WORDS)] for i in range(max(1, tokens - 20)))
    messages: list[Message] = [
        {"role": "system", "content": text},
        {"role": "user", "content": _QUESTION},
    ]
    if next_turn:
        messages += [
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And the sky?"},
        ]
    return messages


def _first_token(engine: BatchEngine, messages: list[Message]) -> tuple[float, int, int]:
    """Seconds to the first token, prompt tokens and cached tokens of one answer."""
    belt: Belt[str] = Belt(8)
    request = GenerationRequest.chat(messages, SamplingParams(max_tokens=1, temperature=0.0))
    belt.trace.mark_enqueued()
    engine.start(request, belt.producer)
    "".join(belt)
    belt.wait_released(60.0)
    trace = belt.trace
    assert trace.first_token is not None
    assert trace.enqueued is not None
    elapsed = trace.first_token - trace.enqueued
    return elapsed, belt.trace.prompt_tokens, belt.trace.cached_tokens


def one_round(tokens: int, n_ctx: int) -> dict[str, float]:
    options: dict[str, Any] = {"slots": 1, "n_ctx": n_ctx, "cache_tokens": n_ctx}
    model = default_model_path()
    with tempfile.TemporaryDirectory(prefix="tokenbelt-restore-") as directory:
        first = BatchEngine(model, prefix_cache_dir=directory, **options)
        try:
            _first_token(first, _conversation(tokens, next_turn=False))
        finally:
            first.close()
        saved = first.statistics()
        nxt = _conversation(tokens, next_turn=True)
        warm = _Timed(model, prefix_cache_dir=directory, **options)
        try:
            restored_tokens = warm.statistics().restored_tokens
            ttft_restored, prompt, cached = _first_token(warm, nxt)
        finally:
            warm.close()
        files = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
    cold = BatchEngine(model, **{**options, "cache_entries": 0})
    try:
        recompute, _, _ = _first_token(cold, nxt)
    finally:
        cold.close()
    restored = warm.restore_s + ttft_restored
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "restore_s": warm.restore_s,
        "ttft_restored_s": ttft_restored,
        "restored_s": restored,
        "recompute_s": recompute,
        "ratio": restored / recompute,
        "bytes_per_token": saved.saved_bytes / max(1, restored_tokens),
        "saved_bytes": saved.saved_bytes,
        "disk_bytes": files,
    }


def run(args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": args.rounds, "n_ctx": args.n_ctx, "sizes": {}}
    for tokens in args.prefixes:
        rounds = [one_round(tokens, args.n_ctx) for _ in range(args.rounds)]
        out["sizes"][str(tokens)] = {
            key: round(statistics.median(r[key] for r in rounds), 4) for key in rounds[0]
        }
    out["target_ratio"] = TARGET_RATIO
    out["targets_met"] = all(s["ratio"] <= TARGET_RATIO for s in out["sizes"].values())
    return out


def print_table(r: dict[str, Any]) -> None:
    print(f"Prefix cache restored from disk vs recomputed, median of {r['rounds']} round(s)")
    print()
    head = ("prefix", "prompt", "cached", "restore_s", "ttft_s", "restored_s", "recompute_s")
    print(" ".join(f"{h:>11}" for h in head), f"{'ratio':>7}", f"{'B/token':>9}")
    for tokens, s in r["sizes"].items():
        cells = (
            tokens,
            s["prompt_tokens"],
            s["cached_tokens"],
            f"{s['restore_s']:.3f}",
            f"{s['ttft_restored_s']:.3f}",
            f"{s['restored_s']:.3f}",
            f"{s['recompute_s']:.3f}",
        )
        print(
            " ".join(f"{c:>11}" for c in cells),
            f"{s['ratio']:>7.3f}",
            f"{s['bytes_per_token']:>9.0f}",
        )
    print()
    ratios = {
        f"ratio<={TARGET_RATIO} at {t}": s["ratio"] <= TARGET_RATIO for t, s in r["sizes"].items()
    }
    print(_harness.targets_line(ratios))


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--prefixes", type=int, nargs="+", default=[500, 1500, 3000], help="prefix tokens"
    )
    parser.add_argument("--n-ctx", type=int, default=4096, help="tokens per sequence")
    args = _harness.parse(parser, argv)
    if args.rounds < 1 or min(args.prefixes) < 32 or max(args.prefixes) + 64 > args.n_ctx:
        parser.error("--rounds must be >= 1, each prefix >= 32 and 64 under --n-ctx")
    _harness.emit(run(args), args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
