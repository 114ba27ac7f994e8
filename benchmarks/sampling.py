"""What the OpenAI sampling options cost: decode rate with and without them, same run.

One runtime on the embedded default model (prefix cache off, so every run computes the
same prompt), greedy decoding of ``--tokens`` tokens per run through the SDK. Each round
runs every variant once, in an order that rotates per round, so a change in machine load
hits all of them; the figures are medians over ``--rounds`` rounds:

- ``plain``: no option (the engine puts plain strings on the belt);
- ``logprobs``: ``logprobs=True, top_logprobs=5`` (a log-softmax over the vocabulary and
  a ``Piece`` per token);
- ``penalties``: ``frequency_penalty``, ``presence_penalty`` and a ``logit_bias`` entry.

Rate = completion tokens after the first / (last token - first token) from each request's
trace, so the prefill is left out. ``*_ratio`` is a variant's rate over ``plain``'s, per
round, then the median (target for ``logprobs_ratio`` and ``penalties_ratio``: >= 0.9).

Run: ``.venv/bin/python benchmarks/sampling.py [--rounds N] [--tokens N] [--json]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _harness
from tokenbelt import Runtime
from tokenbelt.models import default_model_path

MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Tell me a long story about a lighthouse keeper."},
]
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {13: -5}},
}


def rate(model: Any, tokens: int, options: dict[str, Any]) -> float:
    reply = model.complete(MESSAGES, temperature=0, max_tokens=tokens, **options)
    trace = reply.trace
    if trace.first_token is None or trace.last_token is None or trace.completion_tokens < 2:
        raise SystemExit(f"too short a reply to time: {reply.text!r}")
    return (trace.completion_tokens - 1) / (trace.last_token - trace.first_token)


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = list(VARIANTS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    started = time.monotonic()
    with Runtime(keep_alive=None, prefix_cache=False) as runtime:
        model = runtime.load(str(default_model_path()))
        rate(model, 8, {})  # warm up
        for i in range(args.rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                rates[name].append(rate(model, args.tokens, VARIANTS[name]))
    result: dict[str, Any] = {"rounds": args.rounds, "tokens": args.tokens}
    for name in names:
        result[f"{name}_tok_s"] = round(statistics.median(rates[name]), 1)
    for name in names[1:]:
        ratios = [v / p for v, p in zip(rates[name], rates["plain"], strict=True)]
        result[f"{name}_ratio"] = round(statistics.median(ratios), 3)
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main() -> None:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every variant")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per run")
    args = _harness.parse(parser)
    if args.rounds < 1 or args.tokens < 2:
        parser.error("--rounds must be >= 1 and --tokens >= 2")
    _harness.emit(run(args), args.json, print_table)


def print_table(result: dict[str, Any]) -> None:
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
