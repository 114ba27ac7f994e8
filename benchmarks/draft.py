"""What prompt-lookup drafting buys, with no setting changed: each workload's decode rate
with drafting asked off and with the default (drafting decides for itself), same run.

One runtime per model (prefix cache off, so every run computes the same prompt; thread
counts pinned to every usable core), belt capacity ``--capacity`` (a step puts every
accepted token at once: the belt's room bounds a draft). The embedded default model
(``q4_1``) and, with ``--f32``, the same weights in f32 (``benchmarks/model_copies.py``,
made once and kept: a step of a few rows costs little more than one there, the regime of
a GPU). Each round runs both variants of a workload, the order alternating per round, so
a change in machine load hits both; figures are medians over ``--rounds`` rounds:

- ``copy``: "Copy this text exactly:" and four paragraphs (of the edit's passage),
  greedy: the reply repeats the text, which a lookup drafts nearly whole.
  ``{model}_copy_ratio`` = default rate over drafting-off rate (target >= 1.5 on both
  models);
- ``edit``: a ~500-token passage and "Rewrite the text above exactly, changing only
  ...", greedy: the small model paraphrases as it copies, so drafts miss often.
  ``{model}_edit_ratio`` (target >= 1.5 on f32, >= 1.2 on q4_1 or the measured reason);
- ``free``: a story, sampled with a fixed seed: nothing to copy, so drafting must turn
  itself off. ``{model}_free_ratio`` (target >= 0.97);
- ``{model}_{workload}_drafted`` / ``_accepted``: draft tokens verified and accepted over
  the rounds, ``_decisions``: each default run's ``draft_decision``;
- ``{model}_row_cost_{n}``: what a step of n tokens cost over a step of one, as the
  engine measured it (what drafting weighs);
- ``{model}_greedy_same_q8_0``: the edit, once each way, on a q8_0 KV cache (``--kv-type
  q8_0``), where llama.cpp's CPU attention computes every row alike whatever its step
  holds: the text must be the same drafted (target). On the default f16 cache a near tie
  may go either way (``greedy_common_chars``): llama.cpp adds a one-row step's attention
  over 512 or more KV cells up across its threads but computes each row of a few-row
  step on one thread;
- ``cancel_release_p95_ms``: eight edit streams (default model, drafting on), one
  cancelled after a few tokens, ``--cancels`` times; target <= ``step_ms_8`` (the mean
  step of those batches) + 5 ms.

Rate = completion tokens after the first / (last token - first token) from each
request's trace, so the prefill is left out.

Before drafting found its place by agreement and weighed each band's acceptance
(2026-12-05, quiet, 2 rounds of 128 tokens): edit 80.2 -> 77.9 tok/s (0.971; 132 drafted,
63 accepted, then off), free 0.982, greedy text on the q8_0 cache the same, cancel p95 6.6
ms against a 218 ms step of eight. Bare ``llama_decode`` at 600 KV cells, 2 threads, one
sequence of k rows with logits for every row (the shape of a drafted step), 2026-12-07:
Q4_1 2 rows 1.74x one row, 3: 2.26, 5: 3.38, 9: 5.20, 17: 9.03; f32 2: 1.51, 3: 1.73, 5:
2.19, 9: 3.05, 17: 4.57.

Run: ``.venv/bin/python benchmarks/draft.py [--f32] [--rounds N] [--tokens N] [--cancels N]
[--json]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from typing import Any

import _harness
from tokenbelt import Runtime
from tokenbelt.engines import BatchEngine, usable_cores
from tokenbelt.models import default_model_path

PASSAGE = (
    "The old mill stood at the bend of the river, where the water slowed and spread into a "
    "wide, quiet pool. For more than a hundred years the wheel had turned there, grinding "
    "wheat for the farms of the valley, and the miller's family had lived in the stone house "
    "beside it. In spring the river rose with melting snow from the hills, and the children "
    "of the village came to watch the wheel throw white spray into the air. In summer the "
    "water fell low, and the miller opened the sluice gate only in the mornings, when the air "
    "was cool and the farmers brought their carts along the dusty road. Autumn was the "
    "busiest season. The carts came in a long line, loaded with sacks of grain, and the "
    "miller worked from dawn until the lamps were lit. His wife kept the accounts in a thick "
    "leather book, writing each name and each weight in careful letters, and his daughter "
    "carried bread and cheese to the men who waited by the door. Winter was quiet. Ice "
    "formed at the edges of the pool, and the wheel was locked so that it would not crack in "
    "the cold. The family mended sacks, sharpened the grinding stones, and told stories by "
    "the fire. When the railway came to the valley, the farmers began to send their grain to "
    "the big mills in the city, where steam engines turned the stones faster than any river "
    "could. Year by year the line of carts grew shorter. The miller's daughter, grown and "
    "married, moved to the city with her husband, and the old man kept the wheel turning for "
    "the few neighbours who still came. When he died, the house stood empty for a long time. "
    "The roof began to leak, the windows broke, and ivy climbed over the walls. Then, one "
    "spring, a young couple from the city bought the mill. They cleared the ivy, mended the "
    "roof, and repaired the wheel with new oak paddles. Now the mill grinds flour again, "
    "though only on weekends, and visitors come from far away to buy bread baked from wheat "
    "that was ground by the river, just as it was a hundred years ago."
)
EDIT = [
    {
        "role": "user",
        "content": PASSAGE + "\n\nRewrite the text above exactly, changing only 'river' to "
        "'stream'.",
    }
]
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
#: four paragraphs of the passage, which the reply repeats (the small model adds a comma)
COPY_TEXT = "\n\n".join(". ".join(PASSAGE.split(". ")[3 * i : 3 * i + 3]) + "." for i in range(4))
COPY = [{"role": "user", "content": "Copy this text exactly:\n\n" + COPY_TEXT}]
#: each workload's messages and sampling
WORKLOADS: dict[str, tuple[list[dict[str, str]], dict[str, Any]]] = {
    "copy": (COPY, {"temperature": 0.0}),
    "edit": (EDIT, {"temperature": 0.0}),
    "free": (STORY, {"temperature": 0.8}),
}
#: drafting asked off, and no setting (the default: drafting decides for itself)
VARIANTS = ("off", "default")


def one(model: Any, messages: Any, tokens: int, draft: str, **sampling: Any) -> dict[str, Any]:
    asked = {} if draft == "default" else {"draft": draft}
    reply = model.complete(messages, max_tokens=tokens, **asked, **sampling)
    t = reply.trace
    if t.first_token is None or t.last_token is None or t.completion_tokens < 2:
        raise SystemExit(f"too short a reply to time: {reply.text!r}")
    rate = (t.completion_tokens - 1) / (t.last_token - t.first_token)
    return {
        "rate": rate,
        "text": reply.text,
        "drafted": t.draft_tokens,
        "accepted": t.accepted_draft_tokens,
        "decision": t.draft_decision,
    }


def common_chars(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cancels(model: Any, engine: BatchEngine, tokens: int, rounds: int) -> tuple[list[float], float]:
    """Cancel-to-release of one of eight drafting edit streams; and the mean step (ms)."""
    rng = random.Random(7)
    out: list[float] = []
    steps, seconds = 0, 0.0
    for _ in range(rounds):
        streams = [model.stream(EDIT, max_tokens=tokens, temperature=0.0) for _ in range(8)]
        readers = [threading.Thread(target=s.read) for s in streams[1:]]
        for t in readers:
            t.start()
        victim = streams[0]
        pieces = iter(victim)
        for _ in range(rng.randrange(8, 24)):
            next(pieces)
        before, started = engine.statistics().steps, time.perf_counter()
        time.sleep(rng.random() * 0.05)
        victim.cancel()
        victim.wait_released(30)
        out.append((victim.trace.cancel_to_release or 0.0) * 1000)
        time.sleep(0.3)  # the seven others go on: time their steps
        steps += engine.statistics().steps - before
        seconds += time.perf_counter() - started
        for s in streams[1:]:
            s.cancel()
        for t in readers:
            t.join()
    return out, seconds * 1000 / max(steps, 1)


def _runtime(capacity: int, kv_type: str = "f16") -> Runtime:
    """Eight slots, prefix cache off (every run computes the same prompt), thread counts
    pinned (every usable core, the best here): the default tuner may pick another decode
    count for a step, and llama.cpp's one-row attention over an f16 cache adds up across
    its threads, so greedy text would differ with the count, drafting or not."""
    cores = usable_cores()
    return Runtime(
        slots=8,
        keep_alive=None,
        n_ctx=2048,
        prefix_cache=False,
        capacity=capacity,
        n_threads=cores,
        n_threads_batch=cores,
        kv_type=kv_type,
    )


def measure_model(tag: str, path: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Every workload both ways on the model at ``path``, into ``result`` (keys ``tag_*``)."""
    runs = {w: {v: [] for v in VARIANTS} for w in WORKLOADS}  # type: dict[str, dict[str, list[dict[str, Any]]]]
    with _runtime(args.capacity) as runtime:
        model = runtime.load(path)
        engine = model.engines[0]
        assert isinstance(engine, BatchEngine)
        model.complete("Say hi.", max_tokens=8)  # warm up
        for i in range(args.rounds):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            for workload, (messages, sampling) in WORKLOADS.items():
                seeded = {**sampling, "seed": 5 + i} if sampling["temperature"] else sampling
                for draft in order:
                    runs[workload][draft].append(one(model, messages, args.tokens, draft, **seeded))
        for n, cost in engine.statistics().row_costs().items():
            result[f"{tag}_row_cost_{n}"] = round(cost, 2)
        if tag == "q4_1":
            cancel_ms, step_ms = cancels(model, engine, args.tokens, args.cancels)
            result["cancel_release_p95_ms"] = round(_harness.percentile(cancel_ms, 0.95), 2)
            result["cancel_release_max_ms"] = round(max(cancel_ms), 2)
            result["step_ms_8"] = round(step_ms, 2)
    for workload, variants in runs.items():
        for draft, rows in variants.items():
            rate = statistics.median(r["rate"] for r in rows)
            result[f"{tag}_{workload}_{draft}_tok_s"] = round(rate, 1)
        pairs = zip(variants["off"], variants["default"], strict=True)
        result[f"{tag}_{workload}_ratio"] = round(
            statistics.median(d["rate"] / o["rate"] for o, d in pairs), 3
        )
        drafted = variants["default"]
        result[f"{tag}_{workload}_drafted"] = sum(r["drafted"] for r in drafted)
        result[f"{tag}_{workload}_accepted"] = sum(r["accepted"] for r in drafted)
        result[f"{tag}_{workload}_decisions"] = [r["decision"] for r in drafted]
    edits = list(zip(runs["edit"]["off"], runs["edit"]["default"], strict=True))
    result[f"{tag}_greedy_same"] = all(o["text"] == d["text"] for o, d in edits)
    result[f"{tag}_greedy_common_chars"] = min(common_chars(o["text"], d["text"]) for o, d in edits)
    result[f"{tag}_greedy_chars"] = min(len(o["text"]) for o, _ in edits)
    # The same edit on a q8_0 KV cache, where llama.cpp's CPU attention computes each row
    # with one kernel whatever its step holds: greedy text must be the same drafted.
    with _runtime(args.capacity, kv_type="q8_0") as runtime:
        model = runtime.load(path)
        q8 = {d: one(model, EDIT, args.tokens, d, temperature=0.0) for d in VARIANTS}
    result[f"{tag}_greedy_same_q8_0"] = q8["off"]["text"] == q8["default"]["text"]
    result[f"{tag}_greedy_q8_0_accepted"] = q8["default"]["accepted"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    result: dict[str, Any] = {
        "rounds": args.rounds,
        "tokens": args.tokens,
        "capacity": args.capacity,
    }
    measure_model("q4_1", str(default_model_path()), args, result)
    if args.f32:
        from model_copies import copy_of_default

        measure_model("f32", str(copy_of_default("f32")), args, result)
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def models(r: dict[str, Any]) -> list[str]:
    return [tag for tag in ("q4_1", "f32") if f"{tag}_copy_ratio" in r]


def print_table(r: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str]] = []
    goals = {"copy": ">= 1.5", "free": ">= 0.97"}
    for tag in models(r):
        for w in WORKLOADS:
            goal = goals.get(w, ">= 1.5" if tag == "f32" else ">= 1.2")
            rows += [
                (
                    f"{tag} {w} tok/s off / default",
                    f"{r[f'{tag}_{w}_off_tok_s']}/{r[f'{tag}_{w}_default_tok_s']}",
                    "",
                ),
                (f"{tag}_{w}_ratio", str(r[f"{tag}_{w}_ratio"]), goal),
                (
                    f"{tag} {w} drafted/accepted",
                    f"{r[f'{tag}_{w}_drafted']}/{r[f'{tag}_{w}_accepted']}",
                    "",
                ),
            ]
        costs = [
            f"{k.rsplit('_', 1)[1]}: {v}" for k, v in r.items() if k.startswith(f"{tag}_row_cost_")
        ]
        rows.append((f"{tag} row costs", ", ".join(costs), ""))
        rows.append((f"{tag}_greedy_same_q8_0", str(r[f"{tag}_greedy_same_q8_0"]), "True"))
    rows.append(
        ("cancel_release_p95_ms", str(r["cancel_release_p95_ms"]), f"<= {r['step_ms_8'] + 5:.1f}")
    )
    _harness.print_measures(
        f"prompt-lookup drafting, {r['rounds']} rounds of {r['tokens']} tokens, capacity "
        f"{r['capacity']} ({r['seconds']} s)",
        rows,
        30,
    )
    print()
    print(_harness.targets_line(targets(r)))


def targets(r: dict[str, Any]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for tag in models(r):
        out[f"{tag}_copy_ratio"] = r[f"{tag}_copy_ratio"] >= 1.5
        out[f"{tag}_edit_ratio"] = r[f"{tag}_edit_ratio"] >= (1.5 if tag == "f32" else 1.2)
        out[f"{tag}_free_ratio"] = r[f"{tag}_free_ratio"] >= 0.97
        out[f"{tag}_greedy_same_q8_0"] = bool(r[f"{tag}_greedy_same_q8_0"])
    out["cancel_release_p95_ms"] = r["cancel_release_p95_ms"] <= r["step_ms_8"] + 5
    return out


def main() -> None:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both variants")
    parser.add_argument("--tokens", type=int, default=160, help="tokens per run")
    parser.add_argument("--cancels", type=int, default=6, help="cancels in a batch of eight")
    parser.add_argument("--capacity", type=int, default=32, help="belt capacity (bounds a draft)")
    parser.add_argument("--f32", action="store_true", help="also the default model's f32 copy")
    args = _harness.parse(parser)
    if args.rounds < 1 or args.tokens < 2 or args.cancels < 1:
        parser.error("--rounds and --cancels must be >= 1 and --tokens >= 2")
    _harness.emit(run(args), args.json, print_table)


if __name__ == "__main__":
    main()
