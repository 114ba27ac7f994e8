"""The runtime's llama.cpp engine, one stream, against the best bare llama-cpp-python loop.

Everything runs side by side in one process, on the embedded default model:

- **decode**: the batch engine with one sequence (its loop thread, a belt, a reader on
  the main thread; thread counts its own adaptive default) against a plain
  ``Llama.generate`` loop over the same prompt tokens, seed and sampling, counting the
  same tokens. The bare loop runs at its *best* thread count on this machine: every
  count from 1 to the usable cores is tried first (``bare_tok_s_by_threads``), since
  llama-cpp-python's default (half the cores) leaves a 2-core machine half idle.
  Rate = (tokens - 1) / (last token - first token), so prefill is left out of both. Bare
  and engine runs alternate (their order flips every pair) and the medians are
  compared, so machine noise hits both sides. Process CPU time per token (every
  thread) is printed beside: it moves far less than wall time on a busy machine.
- **cancel in decode**: a reader takes a few tokens, waits a random part of a decode step,
  and cancels. Cancel-to-release is ``trace.released - trace.cancel_requested``; tokens
  after cancel are completion tokens counted after the cancel callback ran.
- **cancel in prefill**: the same with a prompt of more than 2,000 tokens, cancelled at a
  random moment of its prefill (before the first token).
- **heartbeat**: an asyncio loop sleeps 10 ms at a time while a long prefill runs on the
  producer thread; the largest gap between two ticks is how long the loop was held up.

Targets: decode_ratio >= 0.95 against the best bare configuration (issue 10); decode
cancel-to-release p95 within one decode step + 5 ms; prefill cancel-to-release p95 <= 50
ms; at most one token after a cancel; heartbeat gaps under 50 ms.

Run: ``.venv/bin/python benchmarks/engine.py [--runs N] [--tokens N] [--cancels N] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import _harness
from tokenbelt.belt import Belt, EndReason, TraceEvent
from tokenbelt.engines import BatchEngine, GenerationRequest, SamplingParams, usable_cores
from tokenbelt.models import default_model_path

SEED = 42
DECODE_PROMPT = "Tell me about the sea, its history, its life and its storms."
#: ~15 tokens per item: 145 items make a prompt of about 2,240 tokens
LONG_PROMPT = " ".join(
    f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(145)
)


@dataclass
class Outcome:
    """One cancelled request."""

    cancel_to_release_ms: float
    tokens_after_cancel: int
    first_token: bool


def _sampling(max_tokens: int, seed: int = SEED) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed)


def _start(
    engine: BatchEngine, request: GenerationRequest, capacity: int
) -> tuple[Belt[str], threading.Thread, dict[str, int]]:
    belt: Belt[str] = Belt(capacity)
    at_cancel: dict[str, int] = {}
    # Registered before the producer starts: runs before the engine's own abort callback.
    belt.on_cancel(lambda _r: at_cancel.setdefault("tokens", belt.trace.completion_tokens))
    return belt, _produce(engine, request, belt), at_cancel


def _produce(engine: BatchEngine, request: GenerationRequest, belt: Belt[str]) -> threading.Thread:
    """Mark ``belt`` enqueued and start the engine producing into it on a thread."""
    belt.trace.mark_enqueued()
    thread = threading.Thread(
        target=belt.produce,
        args=(lambda b: engine.generate(request, b.producer),),
        name="bench-engine",
    )
    thread.start()
    return thread


# -- decode ------------------------------------------------------------------------------------


@dataclass
class DecodeRun:
    """One decode measurement."""

    tok_s: float
    tokens: int
    text: str
    #: process CPU time (every thread) per token, between the first and the last token
    cpu_us_per_token: float
    #: CPU time of the reading thread per token (engine runs only)
    reader_cpu_us_per_token: float = 0.0


def decode_engine(engine: BatchEngine, request: GenerationRequest) -> DecodeRun:
    """The engine producing into a belt, read on this thread."""
    belt: Belt[str] = Belt(8)
    cpu: dict[str, float] = {}

    def observe(event: TraceEvent) -> None:
        if event.kind in ("first_token", "ended"):
            cpu[event.kind] = time.process_time()  # every thread: the engine's loop too

    belt.trace.subscribe(observe)
    thread = _produce(engine, request, belt)
    reader_start = time.thread_time()
    text = "".join(belt)
    reader_cpu = time.thread_time() - reader_start
    thread.join()
    trace = belt.trace
    if belt.end_reason not in (EndReason.STOP, EndReason.LENGTH) or trace.decode_rate is None:
        raise RuntimeError(f"the engine run ended with {belt.end_reason}: {trace.error}")
    n = trace.completion_tokens
    return DecodeRun(
        tok_s=trace.decode_rate,
        tokens=n,
        text=text,
        cpu_us_per_token=(cpu["ended"] - cpu["first_token"]) / (n - 1) * 1e6,
        reader_cpu_us_per_token=reader_cpu / n * 1e6,
    )


def bare_llama(threads: int) -> Any:
    from llama_cpp import Llama

    from tokenbelt.engines import amx_safe

    with amx_safe():  # the weights as tokenbelt's engines load them
        return Llama(
            str(default_model_path()),
            n_ctx=4096,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )


def best_bare_threads(tokens: int) -> tuple[int, dict[int, float]]:
    """The bare loop's best thread count on this machine (every count from 1 to the cores)."""
    rates: dict[int, float] = {}
    for threads in range(1, usable_cores() + 1):
        rates[threads] = statistics.median(
            bare_in_a_process(threads, min(tokens, 64)).tok_s for _ in range(2)
        )
    return max(rates, key=rates.__getitem__), rates


def bare_in_a_process(threads: int, tokens: int) -> DecodeRun:
    """``decode_bare`` in a process of its own.

    llama.cpp's OpenMP threads form one team per calling thread; a bare loop on this
    process's main thread beside the engine's loop thread would make two teams, more
    threads than cores, and libgomp then stops spinning at its barriers, which halves
    single-token decoding on both sides. Apart, each runs as it would alone.
    """
    cmd = [sys.executable, __file__, "--bare", str(threads), "--tokens", str(tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return DecodeRun(**json.loads(done.stdout.strip().splitlines()[-1]))


def bare_main(threads: int, tokens: int) -> None:
    """The ``--bare`` mode: one bare decode run, printed as JSON."""
    request = GenerationRequest.chat(
        [{"role": "user", "content": DECODE_PROMPT}], _sampling(tokens)
    )
    llm = bare_llama(threads)
    try:
        from tokenbelt.engines import chat_formatter, prompt_tokens

        prompt = prompt_tokens(llm._model, chat_formatter(llm._model), request, "bare")
        decode_bare(llm, prompt, request.sampling, tokens)  # warm-up
        run = decode_bare(llm, prompt, request.sampling, tokens)
    finally:
        llm.close()
    print(json.dumps(dataclasses.asdict(run)))


def decode_bare(llm: Any, prompt: list[int], s: SamplingParams, tokens: int) -> DecodeRun:
    """A plain ``Llama.generate`` loop on the same model file, counting the same tokens."""
    import llama_cpp

    vocab = llm._model.vocab
    llm.reset()  # a full prefill, as the engine does for a prompt it has not cached
    llm.set_seed(s.seed if s.seed is not None else SEED)
    stamps: list[float] = []
    cpu: list[float] = []
    out: list[int] = []
    steps = llm.generate(
        prompt,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        temp=s.temperature,
        repeat_penalty=s.repeat_penalty,
    )
    try:
        for token in steps:
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            stamps.append(time.monotonic())
            cpu.append(time.process_time())
            out.append(token)
            if len(out) >= tokens:
                break
    finally:
        steps.close()
        llm.reset()
    n = len(out)
    return DecodeRun(
        tok_s=(n - 1) / (stamps[-1] - stamps[0]),
        tokens=n,
        text=llm.detokenize(out).decode("utf-8", "replace"),
        cpu_us_per_token=(cpu[-1] - cpu[0]) / (n - 1) * 1e6,
    )


# -- cancellation ------------------------------------------------------------------------------


def cancel_in_decode(engine: BatchEngine, step_s: float, rng: random.Random) -> Outcome:
    request = GenerationRequest.chat(
        [{"role": "user", "content": DECODE_PROMPT}], _sampling(512, rng.randrange(1 << 30))
    )
    belt, thread, at_cancel = _start(engine, request, capacity=64)
    reader = iter(belt)
    for _ in range(rng.randint(3, 12)):
        next(reader)
    time.sleep(rng.uniform(0, step_s))  # land anywhere inside a decode step
    belt.cancel()
    thread.join()
    return _outcome(belt, at_cancel)


def cancel_in_prefill(engine: BatchEngine, prefill_s: float, rng: random.Random) -> Outcome:
    request = GenerationRequest(prompt=LONG_PROMPT, sampling=_sampling(8))
    belt, thread, at_cancel = _start(engine, request, capacity=8)
    admitted = threading.Event()
    belt.trace.subscribe(lambda e: admitted.set() if e.kind == "admitted" else None)
    if belt.trace.admitted is None:
        admitted.wait()
    time.sleep(rng.uniform(0.02, prefill_s))
    belt.cancel()
    thread.join()
    return _outcome(belt, at_cancel)


def _outcome(belt: Belt[str], at_cancel: dict[str, int]) -> Outcome:
    trace = belt.trace
    if belt.end_reason is not EndReason.USER_CANCEL or trace.cancel_to_release is None:
        raise RuntimeError(f"the request ended with {belt.end_reason} before the cancel")
    return Outcome(
        cancel_to_release_ms=trace.cancel_to_release * 1000,
        tokens_after_cancel=trace.completion_tokens - at_cancel["tokens"],
        first_token=trace.first_token is not None,
    )


# -- the event loop ----------------------------------------------------------------------------


def heartbeat(engine: BatchEngine, seconds: float) -> list[float]:
    """Gaps (ms) between 10 ms asyncio ticks while a long prefill runs on another thread."""
    request = GenerationRequest(prompt=LONG_PROMPT, sampling=_sampling(8))
    belt, thread, _ = _start(engine, request, capacity=8)

    async def beat() -> list[float]:
        async def consume() -> None:
            with contextlib.suppress(Exception):
                async for _ in belt:
                    pass

        consumer = asyncio.create_task(consume())
        while belt.trace.admitted is None:
            await asyncio.sleep(0.001)
        gaps: list[float] = []
        last = began = time.perf_counter()
        while last - began < seconds and belt.trace.first_token is None:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append((now - last) * 1000)
            last = now
        belt.cancel()
        await consumer
        return gaps

    try:
        return asyncio.run(beat())
    finally:
        belt.cancel()
        thread.join()


# -- report ------------------------------------------------------------------------------------


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(SEED)
    engine = BatchEngine(
        default_model_path(), slots=1, n_ctx=4096, n_threads=args.threads, cache_entries=0
    )
    try:
        request = GenerationRequest.chat(
            [{"role": "user", "content": DECODE_PROMPT}], _sampling(args.tokens)
        )
        bare_threads, bare_sweep = best_bare_threads(args.tokens)
        # warm-up: page in the weights, size the buffers; and how many tokens to count
        tokens = decode_engine(engine, request).tokens
        bare_runs: list[DecodeRun] = []
        engine_runs: list[DecodeRun] = []
        for i in range(args.runs):
            if i % 2 == 0:
                engine_runs.append(decode_engine(engine, request))
                bare_runs.append(bare_in_a_process(bare_threads, tokens))
            else:
                bare_runs.append(bare_in_a_process(bare_threads, tokens))
                engine_runs.append(decode_engine(engine, request))
        bare = statistics.median(r.tok_s for r in bare_runs)
        eng = statistics.median(r.tok_s for r in engine_runs)
        step_s = 1 / bare
        engine_threads = engine.threads

        decode_cancels = [cancel_in_decode(engine, step_s, rng) for _ in range(args.cancels)]
        prefill_tokens = engine.count_prompt_tokens(
            GenerationRequest(prompt=LONG_PROMPT, sampling=_sampling(8))
        )
        prefill_cancels = [
            cancel_in_prefill(engine, args.prefill_window, rng) for _ in range(args.prefill_cancels)
        ]
        gaps = heartbeat(engine, args.heartbeat)
    finally:
        engine.close()

    pairs = [e.tok_s / b.tok_s for e, b in zip(engine_runs, bare_runs, strict=True)]
    decode_release = [o.cancel_to_release_ms for o in decode_cancels]
    prefill_release = [o.cancel_to_release_ms for o in prefill_cancels]
    after = [o.tokens_after_cancel for o in decode_cancels + prefill_cancels]
    step_ms = step_s * 1000
    result: dict[str, Any] = {
        "model": engine.name,
        "n_threads": engine_threads,
        "bare_threads": bare_threads,
        "bare_tok_s_by_threads": {str(k): round(v, 1) for k, v in bare_sweep.items()},
        "runs": args.runs,
        "decode_tokens": tokens,
        "decode_same_text": all(
            e.text == b.text for e, b in zip(engine_runs, bare_runs, strict=True)
        ),
        "decode_tok_s_bare": round(bare, 2),
        "decode_tok_s_engine": round(eng, 2),
        "decode_ratio": round(eng / bare, 4),
        "decode_ratio_pair_median": round(statistics.median(pairs), 4),
        "decode_ratio_per_pair": [round(r, 4) for r in pairs],
        "decode_step_ms": round(step_ms, 3),
        "decode_cpu_us_per_token_bare": round(
            statistics.median(r.cpu_us_per_token for r in bare_runs), 1
        ),
        "decode_cpu_us_per_token_engine": round(
            statistics.median(r.cpu_us_per_token for r in engine_runs), 1
        ),
        "reader_cpu_us_per_token": round(
            statistics.median(r.reader_cpu_us_per_token for r in engine_runs), 1
        ),
        "cancel_release_decode_p50_ms": round(statistics.median(decode_release), 3),
        "cancel_release_decode_p95_ms": round(_p95(decode_release), 3),
        "cancel_release_decode_max_ms": round(max(decode_release), 3),
        "cancel_release_prefill_p50_ms": round(statistics.median(prefill_release), 3),
        "cancel_release_prefill_p95_ms": round(_p95(prefill_release), 3),
        "cancel_release_prefill_max_ms": round(max(prefill_release), 3),
        "prefill_prompt_tokens": prefill_tokens,
        "prefill_cancels_before_first_token": sum(not o.first_token for o in prefill_cancels),
        "tokens_after_cancel_max": max(after),
        "heartbeat_ticks": len(gaps),
        "heartbeat_max_gap_ms": round(max(gaps), 3),
        "heartbeat_p99_gap_ms": round(sorted(gaps)[int(0.99 * (len(gaps) - 1))], 3),
        "python": sys.version.split()[0],
        "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
    }
    result["targets"] = {
        "decode_ratio >= 0.95 (bare at its best thread count)": result["decode_ratio"] >= 0.95,
        "cancel_release_decode_p95_ms <= decode_step_ms + 5": (
            result["cancel_release_decode_p95_ms"] <= step_ms + 5
        ),
        "cancel_release_prefill_p95_ms <= 50": result["cancel_release_prefill_p95_ms"] <= 50,
        "prefill_prompt_tokens >= 2000": prefill_tokens >= 2000,
        "tokens_after_cancel_max <= 1": result["tokens_after_cancel_max"] <= 1,
        "heartbeat_max_gap_ms < 50": result["heartbeat_max_gap_ms"] < 50,
    }
    return result


def print_table(r: dict[str, Any]) -> None:
    title = (
        f"llama.cpp engine vs bare Llama.generate: {r['model']}, threads: {r['n_threads']} "
        f"(bare: {r['bare_threads']}), "
        f"Python {r['python']}, llama-cpp-python {r['llama_cpp_python']}"
    )
    rows = [
        ("decode tok/s, bare (median)", f"{r['decode_tok_s_bare']:.2f}", ""),
        ("decode tok/s, engine (median)", f"{r['decode_tok_s_engine']:.2f}", ""),
        ("decode ratio engine/bare", f"{r['decode_ratio']:.4f}", ">= 0.95"),
        ("decode ratio, median of pairs", f"{r['decode_ratio_pair_median']:.4f}", ""),
        ("decode step ms (bare)", f"{r['decode_step_ms']:.2f}", ""),
        ("decode CPU µs/token, bare", f"{r['decode_cpu_us_per_token_bare']:.1f}", ""),
        ("decode CPU µs/token, engine", f"{r['decode_cpu_us_per_token_engine']:.1f}", ""),
        ("reader CPU µs/token (other thread)", f"{r['reader_cpu_us_per_token']:.1f}", ""),
        ("cancel->release in decode p50 ms", f"{r['cancel_release_decode_p50_ms']:.2f}", ""),
        (
            "cancel->release in decode p95 ms",
            f"{r['cancel_release_decode_p95_ms']:.2f}",
            f"<= {r['decode_step_ms'] + 5:.2f}",
        ),
        ("cancel->release in prefill p50 ms", f"{r['cancel_release_prefill_p50_ms']:.2f}", ""),
        ("cancel->release in prefill p95 ms", f"{r['cancel_release_prefill_p95_ms']:.2f}", "<= 50"),
        ("prefill prompt tokens", str(r["prefill_prompt_tokens"]), ">= 2000"),
        ("tokens after cancel, max", str(r["tokens_after_cancel_max"]), "<= 1"),
        ("heartbeat max gap ms (10 ms ticks)", f"{r['heartbeat_max_gap_ms']:.2f}", "< 50"),
        ("heartbeat p99 gap ms", f"{r['heartbeat_p99_gap_ms']:.2f}", ""),
    ]
    _harness.print_measures(title, rows, 36)
    print()
    print(
        f"{r['runs']} decode pairs of {r['decode_tokens']} tokens "
        f"(same text both sides: {r['decode_same_text']}), per-pair ratios "
        f"{r['decode_ratio_per_pair']}"
    )
    print(_harness.targets_line(r["targets"]))


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--runs", type=int, default=7, help="bare/engine decode pairs")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per decode run")
    parser.add_argument("--cancels", type=int, default=20, help="cancels during decode")
    parser.add_argument("--prefill-cancels", type=int, default=10, help="cancels in prefill")
    parser.add_argument(
        "--prefill-window",
        type=float,
        default=2.0,
        help="cancel at a random moment of the first SECONDS of the long prefill",
    )
    parser.add_argument("--heartbeat", type=float, default=3.0, help="heartbeat seconds")
    parser.add_argument(
        "--threads", type=int, default=None, help="fix the engine's threads (default: adaptive)"
    )
    parser.add_argument("--bare", type=int, help=argparse.SUPPRESS)  # see bare_in_a_process
    args = _harness.parse(parser, argv)
    if args.bare is not None:
        bare_main(args.bare, args.tokens)
        return 0
    if args.runs < 1 or args.cancels < 1 or args.prefill_cancels < 1:
        parser.error("--runs, --cancels and --prefill-cancels must be >= 1")
    if not 2 <= args.tokens <= 1024:
        parser.error("--tokens must be in [2, 1024]")
    _harness.emit(run(args), args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
