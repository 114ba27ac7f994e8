"""The SDK's async stream against a bare ``Llama.generate`` loop, on the embedded default model.

Both sides run in one process on the *same* ``Llama`` object (the loaded model's engine
exposes it as ``engine._llm``), with the same prompt tokens, seed and sampling:

- **sdk**: ``model.stream(messages, ...)`` read with ``async for`` on an asyncio loop. The
  clock starts before the call, so submission, tokenising the chat template, the
  admission, the producer thread and the belt all count.
- **bare**: the loop a user would write by hand: reset the context (the engine forgets it
  too for a request outside a conversation), seed, ``Llama.generate`` over the
  pre-tokenised prompt, detokenise each token, stop at end of generation or
  ``max_tokens``. It runs on a thread of its own, as the SDK's decode does, and the
  clock starts at the reset.

Each run records when every non-empty text piece reached the reader. Rate =
(pieces - 1) / (last piece - first piece), so prefill is left out of the rate; time to
first token = first piece - start. Runs come in sdk/bare pairs (the order flips every
pair), so a change in machine load hits both runs of a pair; the headline figures are
medians over the pairs:

- ``stream_ratio``: median of (sdk rate / bare rate) over ``--rounds`` decode pairs of
  ``--tokens`` tokens; target >= 0.98;
- ``ttft_overhead_ms``: median of (sdk time to first token - bare time to first token)
  over the decode pairs and ``--ttft-rounds`` more pairs of one token each (the prefill
  dominates that time and varies from run to run, so it takes many pairs); target <= 5.

The medians of each side (``sdk_tok_s``, ``bare_tok_s``, ``sdk_ttft_ms``,
``bare_ttft_ms``) are reported beside them, and ``ttft_overhead_outside_prefill_ms``:
the same pairs with each run's own prompt evaluation time (``Llama.eval`` timed on
both sides) taken out, which shows the SDK's fixed cost without the prefill's noise,
and the process CPU time per token of each side (every thread counted), which a busy
machine disturbs far less than wall-clock rates.
A short system message keeps the chat template's default one out, so the prompt (and
the prefill noise in the time to first token) stays small.

On a machine whose cores are shared with other work, llama.cpp's default of one prompt
thread per core makes the prefill, hence the time to first token, swing by whole seconds;
``--batch-threads`` sets the prompt threads of the shared context (both sides alike).

Run: ``.venv/bin/python benchmarks/sdk.py [--rounds N] [--tokens N] [--ttft-rounds N]
[--threads N] [--batch-threads N] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import importlib.metadata
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import _harness
from tokenbelt import EndReason, GenerationRequest, Model, Runtime, SamplingParams
from tokenbelt.engines import LlamaEngine, Message, usable_cores
from tokenbelt.models import default_model_path

SEED = 42
SYSTEM = "Be thorough."
PROMPT = "Tell me about the sea, its history, its life and its storms."
TEMPERATURE = 0.8
NET = 120.0  # a safety net for waits


@dataclass
class Sample:
    """One run, either side."""

    ttft_ms: float
    #: time spent evaluating the prompt (inside the time to first token)
    prefill_ms: float
    #: None for a run of one piece
    tok_s: float | None
    pieces: int
    text: str
    #: process CPU time (every thread) from the start to the end of the run
    cpu_ms: float


class PrefillClock:
    """Wraps ``Llama.eval`` to time the prompt evaluations (more than one token) of a run.

    Both sides go through the same wrapper, which costs two clock reads per call.
    """

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._eval = llm.eval
        self.seconds = 0.0
        llm.eval = self

    def __call__(self, tokens: Sequence[int]) -> None:
        if len(tokens) < 2:
            self._eval(tokens)
            return
        began = time.perf_counter()
        try:
            self._eval(tokens)
        finally:
            self.seconds += time.perf_counter() - began

    def take(self) -> float:
        """Milliseconds of prompt evaluation since the last ``take()``."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds * 1000

    def remove(self) -> None:
        del self._llm.eval


def _sample(
    start: float, stamps: list[float], text: str, prefill: PrefillClock, cpu_start: float
) -> Sample:
    cpu_ms = (time.process_time() - cpu_start) * 1000
    if not stamps:
        raise RuntimeError("a run produced no text")
    span = stamps[-1] - stamps[0]
    return Sample(
        ttft_ms=(stamps[0] - start) * 1000,
        prefill_ms=prefill.take(),
        tok_s=(len(stamps) - 1) / span if len(stamps) > 1 and span > 0 else None,
        pieces=len(stamps),
        text=text,
        cpu_ms=cpu_ms,
    )


def _rate(sample: Sample) -> float:
    if sample.tok_s is None:
        raise RuntimeError(f"a decode run produced {sample.pieces} piece(s); need at least 2")
    return sample.tok_s


async def pairs(
    rounds: int, sdk_run: Callable[[], Awaitable[Sample]], bare_run: Callable[[], Sample]
) -> tuple[list[Sample], list[Sample]]:
    """``rounds`` sdk/bare pairs; the order within a pair flips every round."""
    sdk: list[Sample] = []
    bare: list[Sample] = []
    for i in range(rounds):
        if i % 2 == 0:
            sdk.append(await sdk_run())
            bare.append(bare_run())
        else:
            bare.append(bare_run())
            sdk.append(await sdk_run())
    return sdk, bare


async def sdk_once(
    model: Model, messages: list[Message], sampling: dict[str, Any], prefill: PrefillClock
) -> Sample:
    """One request through the SDK, read with ``async for``."""
    prefill.take()
    stamps: list[float] = []
    pieces: list[str] = []
    cpu_start = time.process_time()
    start = time.perf_counter()
    stream = model.stream(messages, **sampling)
    async for piece in stream:
        stamps.append(time.perf_counter())
        pieces.append(piece)
    if stream.end_reason not in (EndReason.STOP, EndReason.LENGTH):
        raise RuntimeError(f"the SDK run ended with {stream.end_reason}: {stream.trace.error}")
    # The next run needs the slot: wait for the release outside the measured span.
    if not await stream.await_released(NET):
        raise RuntimeError("the SDK run was not released")
    return _sample(start, stamps, "".join(pieces), prefill, cpu_start)


def bare_once(
    engine: LlamaEngine, prompt: list[int], s: SamplingParams, prefill: PrefillClock
) -> Sample:
    """One hand-written ``Llama.generate`` loop on the engine's own ``Llama``."""
    import llama_cpp

    prefill.take()
    llm = engine._llm
    vocab = llm._model.vocab
    is_eog = llama_cpp.llama_vocab_is_eog
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    stamps: list[float] = []
    pieces: list[str] = []
    cpu_start = time.process_time()
    start = time.perf_counter()
    llm.reset()  # a full prefill, as the engine does for a request outside a conversation
    llm.set_seed(s.seed if s.seed is not None else SEED)
    steps = llm.generate(
        prompt,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        temp=s.temperature,
        repeat_penalty=s.repeat_penalty,
    )
    made = 0
    try:
        for token in steps:
            if is_eog(vocab, token):
                break
            made += 1
            piece = decoder.decode(llm.detokenize([token]))
            if piece:
                stamps.append(time.perf_counter())
                pieces.append(piece)
            if made >= s.max_tokens:
                break
    finally:
        steps.close()
    return _sample(start, stamps, "".join(pieces), prefill, cpu_start)


def bare_on_a_thread(
    engine: LlamaEngine, prompt: list[int], s: SamplingParams, prefill: PrefillClock
) -> Sample:
    """``bare_once`` on a thread of its own, as the SDK decodes on a producer thread.

    Which thread calls llama.cpp matters on a busy machine (its prompt threads wait on
    each other); the same placement on both sides keeps that out of the comparison.
    The thread's start is not timed: the clock starts inside it.
    """
    box: list[Sample | BaseException] = []

    def target() -> None:
        try:
            box.append(bare_once(engine, prompt, s, prefill))
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=target, name="bench-bare")
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    messages: list[Message] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PROMPT},
    ]
    sampling: dict[str, Any] = {
        "max_tokens": args.tokens,
        "temperature": TEMPERATURE,
        "seed": SEED,
    }
    params = SamplingParams(**sampling)
    runtime = Runtime(keep_alive=None, n_threads=args.threads, n_ctx=2048, capacity=8)
    try:
        # The single-context engine: one ``Llama`` serves both sides, so the comparison
        # isolates the SDK's own cost (the batch engine's ratio: engine.py, batch.py).
        cores = usable_cores()
        model = runtime.add_engines(
            "smollm2",
            lambda: [
                LlamaEngine(
                    default_model_path(),
                    n_ctx=2048,
                    n_threads=args.threads or cores,
                    n_threads_batch=args.threads or cores,
                )
            ],
        )
        engine = model.engines[0]
        if not isinstance(engine, LlamaEngine):
            raise RuntimeError(f"expected the llama.cpp engine, got {type(engine).__name__}")
        prompt = engine.tokenize_request(GenerationRequest.chat(messages, params))
        llm = engine._llm
        if args.batch_threads is not None:
            import llama_cpp

            llama_cpp.llama_set_n_threads(llm._ctx.ctx, llm.n_threads, args.batch_threads)
            llm.n_threads_batch = args.batch_threads

        short = {**sampling, "max_tokens": 1}
        short_params = SamplingParams(**short)
        clock = PrefillClock(llm)

        async def measure() -> tuple[list[Sample], ...]:
            # Warm-up, both sides: page the weights in, size the buffers.
            await sdk_once(model, messages, sampling, clock)
            bare_on_a_thread(engine, prompt, params, clock)
            decode = await pairs(
                args.rounds,
                lambda: sdk_once(model, messages, sampling, clock),
                lambda: bare_on_a_thread(engine, prompt, params, clock),
            )
            first = await pairs(
                args.ttft_rounds,
                lambda: sdk_once(model, messages, short, clock),
                lambda: bare_on_a_thread(engine, prompt, short_params, clock),
            )
            return (*decode, *first)

        try:
            sdk, bare, sdk_first, bare_first = asyncio.run(measure())
        finally:
            clock.remove()
        threads = {"n_threads": llm.n_threads, "n_threads_batch": llm.n_threads_batch}
        model_name = model.name
    finally:
        runtime.close()

    ratios = [_rate(s) / _rate(b) for s, b in zip(sdk, bare, strict=True)]
    # Time to first token: every pair of both phases.
    sdk_ttfts = [s.ttft_ms for s in sdk + sdk_first]
    bare_ttfts = [b.ttft_ms for b in bare + bare_first]
    overheads = [s - b for s, b in zip(sdk_ttfts, bare_ttfts, strict=True)]
    # The same with each run's own prompt evaluation taken out: what is left is the
    # SDK's work (and the bare loop's) around the prefill, without the prefill's noise.
    outside = [
        (s.ttft_ms - s.prefill_ms) - (b.ttft_ms - b.prefill_ms)
        for s, b in zip(sdk + sdk_first, bare + bare_first, strict=True)
    ]
    sdk_rate = statistics.median(_rate(s) for s in sdk)
    bare_rate = statistics.median(_rate(b) for b in bare)
    sdk_ttft = statistics.median(sdk_ttfts)
    bare_ttft = statistics.median(bare_ttfts)
    result: dict[str, Any] = {
        "stream_ratio": round(statistics.median(ratios), 4),
        "ttft_overhead_ms": round(statistics.median(overheads), 3),
        "sdk_tok_s": round(sdk_rate, 2),
        "bare_tok_s": round(bare_rate, 2),
        "sdk_ttft_ms": round(sdk_ttft, 3),
        "bare_ttft_ms": round(bare_ttft, 3),
        "ratio_of_median_rates": round(sdk_rate / bare_rate, 4),
        "difference_of_median_ttft_ms": round(sdk_ttft - bare_ttft, 3),
        "ttft_overhead_outside_prefill_ms": round(statistics.median(outside), 3),
        "sdk_prefill_ms": round(statistics.median(s.prefill_ms for s in sdk + sdk_first), 3),
        "bare_prefill_ms": round(statistics.median(b.prefill_ms for b in bare + bare_first), 3),
        "sdk_cpu_ms_per_token": round(statistics.median(s.cpu_ms / s.pieces for s in sdk), 3),
        "bare_cpu_ms_per_token": round(statistics.median(b.cpu_ms / b.pieces for b in bare), 3),
        "stream_ratio_per_pair": [round(r, 4) for r in ratios],
        "ttft_overhead_per_pair_ms": [round(o, 3) for o in overheads],
        "ttft_pairs": len(overheads),
        "rounds": args.rounds,
        "max_tokens": args.tokens,
        "pieces": sorted({s.pieces for s in sdk + bare}),
        "same_text": all(s.text == bare[0].text for s in sdk + bare),
        "prompt_tokens": len(prompt),
        "model": model_name,
        **threads,
        "python": sys.version.split()[0],
        "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
    }
    result["targets"] = {
        "stream_ratio >= 0.98": result["stream_ratio"] >= 0.98,
        "ttft_overhead_ms <= 5": result["ttft_overhead_ms"] <= 5,
    }
    return result


def print_table(r: dict[str, Any]) -> None:
    title = (
        f"SDK async stream vs bare Llama.generate: {r['model']}, threads "
        f"{r['n_threads']} (batch {r['n_threads_batch']}), Python {r['python']}, "
        f"llama-cpp-python {r['llama_cpp_python']}"
    )
    rows = [
        ("decode tok/s, bare (median)", f"{r['bare_tok_s']:.2f}", ""),
        ("decode tok/s, sdk async stream (median)", f"{r['sdk_tok_s']:.2f}", ""),
        ("stream ratio sdk/bare (median of pairs)", f"{r['stream_ratio']:.4f}", ">= 0.98"),
        ("time to first token ms, bare (median)", f"{r['bare_ttft_ms']:.2f}", ""),
        ("time to first token ms, sdk (median)", f"{r['sdk_ttft_ms']:.2f}", ""),
        ("ttft overhead ms (median of pairs)", f"{r['ttft_overhead_ms']:.2f}", "<= 5"),
    ]
    _harness.print_measures(title, rows, 42, target_width=8)
    print()
    print(
        f"{r['rounds']} decode pairs of max {r['max_tokens']} tokens (pieces per run "
        f"{r['pieces']}, same text every run: {r['same_text']}), {r['ttft_pairs']} pairs "
        f"for the time to first token, {r['prompt_tokens']} prompt tokens"
    )
    print(f"per-pair ratios {r['stream_ratio_per_pair']}")
    print(f"per-pair ttft overhead ms {r['ttft_overhead_per_pair_ms']}")
    print(
        f"ratio of median rates {r['ratio_of_median_rates']}, difference of median ttft "
        f"{r['difference_of_median_ttft_ms']} ms"
    )
    print(
        f"ttft overhead with each run's prefill taken out (median of pairs): "
        f"{r['ttft_overhead_outside_prefill_ms']} ms (prefill medians: sdk "
        f"{r['sdk_prefill_ms']} ms, bare {r['bare_prefill_ms']} ms)"
    )
    print(
        f"process CPU per token in the decode runs (prefill included, median): sdk "
        f"{r['sdk_cpu_ms_per_token']} ms, bare {r['bare_cpu_ms_per_token']} ms"
    )
    print(_harness.targets_line(r["targets"]))


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=8, help="sdk/bare decode pairs")
    parser.add_argument("--tokens", type=int, default=128, help="max tokens per decode run")
    parser.add_argument(
        "--ttft-rounds",
        type=int,
        default=16,
        help="extra sdk/bare pairs of one token each, for the time to first token",
    )
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp decode threads")
    parser.add_argument(
        "--batch-threads", type=int, default=None, help="llama.cpp prompt (prefill) threads"
    )
    args = _harness.parse(parser, argv)
    if args.rounds < 1 or args.ttft_rounds < 0:
        parser.error("--rounds must be >= 1 and --ttft-rounds >= 0")
    if args.batch_threads is not None and args.batch_threads < 1:
        parser.error("--batch-threads must be >= 1")
    if not 2 <= args.tokens <= 1024:
        parser.error("--tokens must be in [2, 1024]")
    _harness.emit(run(args), args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
