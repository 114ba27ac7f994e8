"""Structured output: decode speed under a JSON-schema grammar, and schema compile time.

In one process, on the embedded default model, one runtime (the batch engine, one
slot), rounds alternating the order of:

- **free**: a reply without a grammar;
- **schema**: the same prompt and sampling under a JSON-schema grammar, sampled the way
  tokenbelt does it: free first, the chosen token checked against the grammar, the
  grammar applied to the whole vocabulary only when it refuses that token;
- **ranges**: the same under a schema with ranges and formats (an integer range, a
  bounded number, an email: issue 24's keywords, in the grammar tokenbelt adds to the
  converter's);
- **full** (``--full``): the grammar applied to the whole vocabulary at every step, the
  plain way, to show what the check-first step is worth.

Rates are the traces' decode rates (tokens after the first over the time from the first
token to the last), so prompt evaluation counts on neither side. Medians over
``--rounds``. Also reported: the schema's compile time cold (an empty cache) and cached,
and the time llama.cpp takes to parse the compiled grammar (every request does it once,
at submit, before it queues).

With ``--tools`` (issue 24, native formats), also:

- **call_<family>** (``tokenbelt``, ``llama3``, ``mistral``): one required call in that
  family's form (its grammar), the tool's arguments the people list of **schema**;
- **lazy_<family>**: free text under that family's lazy ``tool_choice: auto`` grammar,
  which the prose reply never triggers (free text must cost nothing until a call).

The grammar is what differs between families, so these run on the embedded model with
the family's grammar given directly (its prompt is the free one's).

Targets: ``ratio = schema / free >= 0.8`` (issue 13), ``ratio_ranges = ranges / free
>= 0.8`` and ``ratio_lazy_<family> >= 0.97`` (issue 24). Every ratio is the median over
rounds of a side's rate over a free twin run next to it (after it, before it in odd
rounds) with the same seed (for a lazy side the same text, so the same decode work), as
``benchmarks/isolation.py`` pairs its sides: rates drift over the minutes a round takes
(10% on a 2-core machine), and a ratio against the round's one free run measured that
drift as much as the grammar.

Run: ``.venv/bin/python benchmarks/grammar.py [--rounds N] [--tokens N] [--full]
[--tools] [--json]``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import _harness
from tokenbelt import Runtime
from tokenbelt.engines import (
    BatchEngine,
    GenerationRequest,
    Grammar,
    GrammarSampler,
    Message,
    check_grammar,
    clear_schema_cache,
    sampling_from,
    schema_grammar,
)
from tokenbelt.models import default_model_path
from tokenbelt.runtime import structured

PROMPT: list[Message] = [
    {"role": "user", "content": "List many people you know, with their city and a short note."}
]
#: long enough that a reply fills ``--tokens`` under the grammar
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 60,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer"},
                    "city": {"type": "string", "maxLength": 24},
                    "note": {"type": "string", "maxLength": 60},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["friend", "family", "work"]},
                        "maxItems": 3,
                    },
                },
                "required": ["name", "age", "city", "note", "tags"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
}
_PERSON = SCHEMA["properties"]["people"]["items"]
#: the same list, its people with ranges and formats
RANGES: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {
            **SCHEMA["properties"]["people"],
            "items": {
                **_PERSON,
                "properties": {
                    **_PERSON["properties"],
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
                    "email": {"type": "string", "format": "email"},
                },
                "required": [*_PERSON["required"], "score", "email"],
            },
        }
    },
    "required": ["people"],
}


def compile_times(rounds: int) -> dict[str, float]:
    cold, cached = [], []
    for _ in range(rounds):
        clear_schema_cache()
        began = time.perf_counter()
        schema_grammar(SCHEMA)
        cold.append(time.perf_counter() - began)
        began = time.perf_counter()
        schema_grammar(SCHEMA)
        cached.append(time.perf_counter() - began)
    return {
        "compile_cold_ms": statistics.median(cold) * 1000,
        "compile_cached_ms": statistics.median(cached) * 1000,
    }


def parse_time(engine: BatchEngine, rounds: int) -> float:
    grammar = schema_grammar(SCHEMA)
    took = []
    for _ in range(rounds):
        began = time.perf_counter()
        check_grammar(engine._lib, engine._vocab, grammar)
        took.append(time.perf_counter() - began)
    return statistics.median(took) * 1000


FAMILIES = ("tokenbelt", "llama3", "mistral")
#: a tool whose arguments are the people list: a call long enough to measure
PEOPLE_TOOL = structured.tools_from([{"name": "save_people", "parameters": SCHEMA}])


def tool_grammar(side: str) -> Grammar:
    kind, family = side.split("_", 1)
    choice = "required" if kind == "call" else "auto"
    grammar = structured.tools_grammar(PEOPLE_TOOL, choice, tool_format=family)
    assert grammar is not None
    return grammar


def one_tools(model: Any, side: str, tokens: int, seed: int) -> tuple[float, int]:
    sampling = sampling_from({"max_tokens": tokens, "temperature": 0.8, "seed": seed})
    request = GenerationRequest(messages=tuple(PROMPT), sampling=sampling)
    if side != "free":
        request = GenerationRequest(
            messages=tuple(PROMPT), sampling=sampling, grammar=tool_grammar(side)
        )
    reply = model.submit(request).read()
    rate = reply.trace.decode_rate
    if rate is None:
        raise RuntimeError(f"the {side} reply had no decode rate ({reply.text!r})")
    return rate, reply.usage.completion_tokens


def one(model: Any, side: str, tokens: int, seed: int) -> tuple[float, int]:
    if side.startswith(("call_", "lazy_")):
        return one_tools(model, side, tokens, seed)
    schema = {"free": None, "ranges": RANGES}.get(side, SCHEMA)
    GrammarSampler.check_first = side != "full"
    try:
        stream = model.stream(PROMPT, schema=schema, max_tokens=tokens, temperature=0.8, seed=seed)
        reply = stream.read()
    finally:
        GrammarSampler.check_first = True
    rate = reply.trace.decode_rate
    if rate is None:
        raise RuntimeError(f"the {side} reply had no decode rate ({reply.text!r})")
    return rate, reply.usage.completion_tokens


def main() -> None:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--full", action="store_true", help="also the grammar at every step")
    parser.add_argument("--tools", action="store_true", help="also each family's call grammars")
    args = _harness.parse(parser)
    if not 1 <= args.rounds <= 100 or not 8 <= args.tokens <= 4000:
        parser.error("--rounds must be 1..100 and --tokens 8..4000")

    sides = ["free", "schema", "ranges"] + (["full"] if args.full else [])
    if args.tools:
        sides += [f"{kind}_{f}" for f in FAMILIES for kind in ("call", "lazy")]
    rates: dict[str, list[float]] = {s: [] for s in sides}
    counts: dict[str, list[int]] = {s: [] for s in sides}
    result: dict[str, Any] = compile_times(max(args.rounds, 5))
    with Runtime(slots=1, keep_alive=None, prefix_cache=False) as runtime:
        model = runtime.load(str(default_model_path()))
        engine = model.engines[0]
        assert isinstance(engine, BatchEngine)
        result["grammar_parse_ms"] = parse_time(engine, max(args.rounds, 5))
        one(model, "schema", 8, 0)  # warm up: threads, caches
        one(model, "ranges", 8, 0)
        pairs: dict[str, list[float]] = {s: [] for s in sides if s != "free"}
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else list(reversed(sides))
            for side in order:
                # Each side's free twin runs next to it, before it in odd rounds.
                twin = one(model, "free", args.tokens, seed=r)[0] if side in pairs and r % 2 else 0
                rate, n = one(model, side, args.tokens, seed=r)
                rates[side].append(rate)
                counts[side].append(n)
                if side in pairs:  # the drift between the two cancels out of their ratio
                    twin = twin or one(model, "free", args.tokens, seed=r)[0]
                    pairs[side].append(rate / twin)
    for side in sides:
        result[f"{side}_tok_s"] = statistics.median(rates[side])
        result[f"{side}_tokens"] = statistics.median(counts[side])
    for side, ratios in pairs.items():
        result["ratio" if side == "schema" else f"ratio_{side}"] = statistics.median(ratios)
    result.update(rounds=args.rounds, max_tokens=args.tokens)
    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    _harness.emit(rounded if args.json else result, args.json, print_table)


def print_table(result: dict[str, Any]) -> None:
    print(f"{'measure':<24}{'value':>12}")
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<24}{shown:>12}")
    print("targets: ratio >= 0.8, ratio_ranges >= 0.8, ratio_lazy_* >= 0.97 (--tools)")


if __name__ == "__main__":
    main()
