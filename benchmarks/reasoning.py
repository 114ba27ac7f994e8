"""Thinking models: what the reasoning split costs, how soon a thinking deadline answers.

In one process, on the embedded default model with a Qwen3-style thinking template put in
(its generation prompt opens ``<think>``, so every reply reasons first), two batch engines
of one slot each, rounds alternating their order:

- **split**: the engine as it serves (markers found, the reply split into reasoning and
  answer ``Piece``\\ s);
- **raw**: the same model with ``reasoning=False``: one text, markers and all.

Each round streams one greedy reply of ``--tokens`` tokens (all reasoning: nothing ends
it) through a belt read on this thread; the rate is the reader's (items after the first
over the time from the first to the last). Target: ``ratio = split / raw >= 0.98``.

Then **deadline**: ``--deadlines`` replies with ``reasoning_timeout`` ``--timeout``
seconds; for each, the time from the deadline (the reasoning's first token plus the
timeout) to the first answer token (``trace.answer_started``: sampled, shown or not),
against that request's median step (its median gap between tokens). Target: p95 latency
<= median step + 5 ms. Also the time to the first answer item the reader takes (an
answer's leading white space is never shown, so that waits for the model's first word:
the default model, which is no thinking model, often writes newlines first), the
time from the deadline to the phase's recorded end (the engine's timer aborts a step
that computes the thinking sequence alone, so the end marker goes into the next step),
and how many tokens the end marker is (this vocabulary has no ``</think>`` token: its
text tokenized; the step that decodes it is that much longer than a decode step).
``--threads N`` fixes the thread counts (the tuner's trials otherwise add steps of
their own to short runs).

Run: ``.venv/bin/python benchmarks/reasoning.py [--rounds N] [--tokens N]
[--deadlines N] [--timeout S] [--threads N] [--json]``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _harness
from templates import THINKING_TEMPLATE, with_template
from tokenbelt.belt import Belt
from tokenbelt.engines import BatchEngine, GenerationRequest, Message, Piece, SamplingParams
from tokenbelt.models import default_model_path

STORY: list[Message] = [
    {"role": "user", "content": "Write a long story about a dragon who learns to fly."}
]
#: slack the deadline target allows beyond one step
SLACK_S = 0.005


def stream(engine: BatchEngine, **sampling: Any) -> tuple[Belt[str], list[tuple[float, str]]]:
    """One reply read to its end here: its belt, and (monotonic time, part) per item."""
    request = GenerationRequest.chat(STORY, SamplingParams(temperature=0.0, **sampling))
    engine.count_prompt_tokens(request)
    belt: Belt[str] = Belt(64)
    belt.trace.mark_enqueued()
    engine.start(request, belt.producer)
    seen = [
        (time.monotonic(), piece.part if isinstance(piece, Piece) else "answer") for piece in belt
    ]
    belt.wait_released(30.0)
    return belt, seen


def rate(seen: list[tuple[float, str]]) -> float:
    span = seen[-1][0] - seen[0][0]
    return (len(seen) - 1) / span if span > 0 else 0.0


def measure(
    path: Path, rounds: int, tokens: int, deadlines: int, timeout: float, threads: int | None
) -> dict[str, Any]:
    options: dict[str, Any] = {"slots": 1, "n_ctx": 2048, "cache_entries": 0}
    if threads:
        options.update(n_threads=threads, n_threads_batch=threads)
    split = BatchEngine(path, **options)
    raw = BatchEngine(path, reasoning=False, **options)
    try:
        assert split.reasoning is not None
        assert raw.reasoning is None
        marker_tokens = len(split.reasoning.end_tokens)
        for engine in (split, raw):  # warm: the first reply pays for paging in
            stream(engine, max_tokens=8)
        rates: dict[str, list[float]] = {"split": [], "raw": []}
        for i in range(rounds):
            order = [("split", split), ("raw", raw)]
            for name, engine in order if i % 2 == 0 else order[::-1]:
                rates[name].append(rate(stream(engine, max_tokens=tokens)[1]))
        # The raw engine's work is done: closed, its threads cannot share the cores with
        # the deadline replies (two llama.cpp contexts in one process make two teams).
        raw.close()
        latencies: list[float] = []
        tokens_at: list[float] = []
        ends: list[float] = []
        steps: list[float] = []
        for _ in range(deadlines):
            belt, seen = stream(split, max_tokens=tokens, reasoning_timeout=timeout)
            t = belt.trace
            if t.reasoning_ended_by != "deadline" or t.reasoning_started is None:
                continue  # the reply ended before its deadline: nothing to time
            deadline = t.reasoning_started + timeout
            assert t.reasoning_ended is not None
            ends.append(t.reasoning_ended - deadline)
            if t.answer_started is not None:
                tokens_at.append(t.answer_started - deadline)
            first = next((at for at, part in seen if part == "answer" and at >= deadline), None)
            if first is None:
                continue
            latencies.append(first - deadline)
            steps.append(statistics.median(t.token_gaps))
    finally:
        split.close()
        raw.close()
    split_rate = statistics.median(rates["split"])
    raw_rate = statistics.median(rates["raw"])
    p95 = _harness.percentile(latencies, 0.95) if latencies else None
    end95 = _harness.percentile(ends, 0.95) if ends else None
    token95 = _harness.percentile(tokens_at, 0.95) if tokens_at else None
    step = statistics.median(steps) if steps else None
    return {
        "rounds": rounds,
        "tokens": tokens,
        "split_tok_s": round(split_rate, 2),
        "raw_tok_s": round(raw_rate, 2),
        "ratio": round(split_rate / raw_rate, 4) if raw_rate else None,
        "deadlines_timed": len(latencies),
        "deadline_to_answer_token_p95_ms": None if token95 is None else round(token95 * 1000, 2),
        "deadline_to_answer_p95_ms": None if p95 is None else round(p95 * 1000, 2),
        "deadline_to_phase_end_p95_ms": None if end95 is None else round(end95 * 1000, 2),
        "step_ms": None if step is None else round(step * 1000, 2),
        "marker_tokens": marker_tokens,
    }


def table(result: dict[str, Any]) -> None:
    p95, step = result["deadline_to_answer_token_p95_ms"], result["step_ms"]
    limit = None if step is None else step + SLACK_S * 1000
    rows = [
        ("split tok/s", f"{result['split_tok_s']}", ""),
        ("raw tok/s", f"{result['raw_tok_s']}", ""),
        ("ratio split/raw", f"{result['ratio']}", ">= 0.98"),
        ("deadline to answer token p95 ms", f"{p95}", f"<= {limit:.1f}" if limit else "-"),
        ("deadline to answer shown p95 ms", f"{result['deadline_to_answer_p95_ms']}", ""),
        ("deadline to phase end p95 ms", f"{result['deadline_to_phase_end_p95_ms']}", ""),
        ("median step ms", f"{step}", ""),
        ("end marker tokens", f"{result['marker_tokens']}", ""),
    ]
    _harness.print_measures(
        f"thinking template, {result['rounds']} rounds of {result['tokens']} tokens, "
        f"{result['deadlines_timed']} deadlines timed",
        rows,
        31,
    )
    print()
    print(_harness.targets_line(targets(result)))


def targets(result: dict[str, Any]) -> dict[str, bool]:
    p95, step = result["deadline_to_answer_token_p95_ms"], result["step_ms"]
    return {
        "ratio": result["ratio"] is not None and result["ratio"] >= 0.98,
        "deadline": p95 is not None and step is not None and p95 <= step + SLACK_S * 1000,
    }


def main() -> None:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--deadlines", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=0.3, help="reasoning_timeout, seconds")
    parser.add_argument("--threads", type=int, default=None, help="fixed thread counts")
    args = _harness.parse(parser)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "thinking.gguf"
        with_template(Path(default_model_path()), path, THINKING_TEMPLATE)
        result = measure(path, args.rounds, args.tokens, args.deadlines, args.timeout, args.threads)
    result["targets"] = targets(result)
    _harness.emit(result, args.json, table)


if __name__ == "__main__":
    main()
