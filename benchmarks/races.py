"""End-cause races: every pair of ends driven against each other, for as long as you like.

The same driver as ``tests/runtime/test_end_races.py`` (``tests/races.py``): each request
runs on a scripted engine while two causes (reader stop, ``cancel()`` from another
thread, disconnect, cancel endpoint, each deadline, natural end, engine failure,
shutdown, unload) fire at the same point, with the interpreter switching threads as
often as it can. Every trace event is checked against the timeline invariants.
Prints requests per end reason beside the metrics' totals, the invariant violations
and any request whose story was wrong; exits 1 if there was one.

Run: ``.venv/bin/python benchmarks/races.py [--seconds 300] [--requests N] [--seed N] [--json]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import time
from typing import Any

import _harness
import races
from tokenbelt.belt import invariants


def main() -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long (default 120)")
    parser.add_argument("--requests", type=int, default=None, help="stop after N requests")
    parser.add_argument("--seed", type=int, default=0)
    args = _harness.parse(parser)
    if args.seconds <= 0 or (args.requests is not None and args.requests < 1):
        parser.error("--seconds and --requests must be positive")
    invariants.enable()
    started = time.monotonic()
    out, totals = races.run(seconds=args.seconds, max_requests=args.requests, seed=args.seed)
    elapsed = time.monotonic() - started
    violations = invariants.violations()
    ok = not out.problems and not violations and dict(totals) == dict(out.reasons)
    result = {
        "requests": out.requests,
        "pairs": len(races.PAIRS),
        "seconds": round(elapsed, 1),
        "reasons": dict(out.reasons),
        "metrics": dict(totals),
        "violations": violations,
        "problems": out.problems,
        "ok": ok,
    }

    def table(_result: dict[str, Any]) -> None:
        print(f"{len(races.PAIRS)} pairs of causes, {elapsed:.1f} s")
        for line in races.summary(out, totals):
            print(line)
        print("ok" if ok else "FAILED")

    _harness.emit(result, args.json, table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
