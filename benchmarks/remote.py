"""A tokenbelt front over an upstream: what the front costs, and how fast a stop reaches it.

Three figures, one run, against one upstream (by default a ``tokenbelt serve`` of the
embedded model in a process of its own; ``--upstream URL`` for any OpenAI-compatible
server, such as ``vllm serve`` on a GPU machine):

- **sse_ratio_remote**: decode tokens/s seen by an SSE client through the front
  (``tokenbelt serve --upstream``, a process of its own), divided by the
  same client streaming from the upstream directly, same prompt, seed and sampling.
  Trials alternate between the two paths and the medians are compared. Target: >= 0.97.
- **ttft_overhead_remote_ms**: the median, over trial pairs, of time to first token
  through the front minus directly (client clock: request sent -> first content chunk;
  each front trial runs right after its direct one, so slow drift in the machine's load
  cancels out). Target: <= 5 ms.
- **front_cancel_to_upstream_release_p95_ms**: a client closes its stream at the front
  after a few tokens; from the front's ``cancel_requested`` to the upstream's own
  ``released`` (both traces, wall-clock anchored: the upstream must be a tokenbelt).
  Target: <= 50 ms.

Run: ``.venv/bin/python benchmarks/remote.py [--json] [--trials N] [--tokens N]
[--upstream URL] [--model NAME]``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Any

import httpx

import _harness
from tokenbelt.engines import usable_cores
from tokenbelt.models import default_model_path

TARGET_RATIO = 0.97
TARGET_TTFT_MS = 5.0
TARGET_RELEASE_MS = 50.0
PROMPT = "Once upon a time, in a village by the sea, there lived an old fisherman who"
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
#: content chunks read before a leaving client closes
READ_BEFORE_LEAVING = 4
NET = 120.0


def own_upstream(threads: int | None) -> contextlib.AbstractContextManager[str]:
    """``tokenbelt serve`` of the embedded model, one slot, in a process of its own.

    ``threads`` fixes llama.cpp's threads: on a small machine, fewer than the cores leave
    one to the front and the client, whose work would otherwise stall the decode steps
    of the upstream (a CPU upstream shares the machine; a GPU one does not).
    """
    port = _harness.free_port()
    command = [sys.executable, "-m", "tokenbelt", "serve", str(default_model_path())]
    command += ["--port", str(port), "--slots", "1", "--log-level", "warning"]
    if threads:
        command += ["--threads", str(threads), "--threads-batch", str(threads)]
    return _harness.server_process(command, port, NET)


def front(upstream: str) -> contextlib.AbstractContextManager[str]:
    """``tokenbelt serve --upstream``, in a process of its own as it is deployed."""
    port = _harness.free_port()
    command = [sys.executable, "-m", "tokenbelt", "serve", "--upstream", upstream]
    command += ["--port", str(port), "--upstream-concurrency", "1", "--log-level", "warning"]
    return _harness.server_process(command, port, NET)


def _body(model: str, tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": tokens, "stream": True, **SAMPLING}


def stream_once(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """(time to first token, decode tokens/s, tokens) of one SSE completion, client side."""
    sent = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=NET) as r:
        r.raise_for_status()
        stamps = _harness.text_times(r.iter_lines())
    if len(stamps) < 2:
        raise SystemExit(f"{url} streamed {len(stamps)} tokens: nothing to time")
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return stamps[0] - sent, rate, len(stamps)


def leave_once(client: httpx.Client, front_url: str, body: dict[str, Any]) -> float | None:
    """Close a stream at the front after a few tokens; ms from the front's stop to the
    upstream's release (None when the upstream sends no trace)."""
    with client.stream("POST", f"{front_url}/v1/completions", json=body, timeout=NET) as r:
        request_id = r.headers["x-request-id"]
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text":"' in line.replace(" ", ""):
                seen += 1
                if seen >= READ_BEFORE_LEAVING:
                    break
    deadline = time.monotonic() + NET
    while True:
        trace = client.get(f"{front_url}/v1/requests/{request_id}", timeout=NET).json()
        if trace["timeline_ms"]["released"] is not None:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{request_id} was not released at the front")
        time.sleep(0.005)
    upstream = (trace.get("upstream") or {}).get("trace")
    if not upstream or upstream["timeline_ms"]["released"] is None:
        return None
    stop = trace["enqueued_at"] + trace["timeline_ms"]["cancel_requested"] / 1000
    released = upstream["enqueued_at"] + upstream["timeline_ms"]["released"] / 1000
    return (released - stop) * 1000


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def run(upstream: str, model: str | None, trials: int, tokens: int) -> dict[str, Any]:
    if model is None:
        listed = httpx.get(f"{upstream}/v1/models", timeout=NET).json()["data"]
        loaded = [m for m in listed if (m.get("tokenbelt") or {}).get("loaded", True)]
        model = str(loaded[0]["id"])
    body = _body(model, tokens)
    with front(upstream) as front_url, httpx.Client() as client:
        stream_once(client, upstream, body)  # warm both paths: connections, caches
        stream_once(client, front_url, body)
        direct: list[tuple[float, float, int]] = []
        fronted: list[tuple[float, float, int]] = []
        for _ in range(trials):
            direct.append(stream_once(client, upstream, body))
            fronted.append(stream_once(client, front_url, body))
        releases = [
            ms
            for _ in range(trials)
            if (ms := leave_once(client, front_url, {**body, "max_tokens": 256})) is not None
        ]
    rate_direct = statistics.median(r for _, r, _ in direct)
    rate_front = statistics.median(r for _, r, _ in fronted)
    ttft_direct = statistics.median(t for t, _, _ in direct) * 1000
    ttft_front = statistics.median(t for t, _, _ in fronted) * 1000
    overhead = statistics.median(f[0] - d[0] for d, f in zip(direct, fronted, strict=True))
    return {
        "upstream": upstream,
        "model": model,
        "trials": trials,
        "tokens": tokens,
        "direct_tok_s": round(rate_direct, 2),
        "front_tok_s": round(rate_front, 2),
        "sse_ratio_remote": round(rate_front / rate_direct, 4),
        "ttft_direct_ms": round(ttft_direct, 2),
        "ttft_front_ms": round(ttft_front, 2),
        "ttft_overhead_remote_ms": round(overhead * 1000, 2),
        "front_cancel_to_upstream_release_p95_ms": round(p95(releases), 2) if releases else None,
        "targets": {
            "sse_ratio_remote": TARGET_RATIO,
            "ttft_overhead_remote_ms": TARGET_TTFT_MS,
            "front_cancel_to_upstream_release_p95_ms": TARGET_RELEASE_MS,
        },
    }


def main() -> None:
    parser = _harness.parser(__doc__)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per timed stream")
    parser.add_argument("--upstream", help="an OpenAI-compatible base URL (default: own)")
    parser.add_argument("--model", help="the upstream's model (default: the first listed)")
    parser.add_argument(
        "--upstream-threads",
        type=int,
        help="llama.cpp threads of the own upstream (default: all but one core, at least 1)",
    )
    args = _harness.parse(parser)
    if args.upstream:
        result = run(args.upstream.rstrip("/"), args.model, args.trials, args.tokens)
    else:
        threads = args.upstream_threads or max(1, usable_cores() - 1)
        with own_upstream(threads) as url:
            result = run(url, args.model, args.trials, args.tokens)
    _harness.emit(result, args.json, print_table)


def print_table(result: dict[str, Any]) -> None:
    for key, value in result.items():
        if key != "targets":
            target = result["targets"].get(key)
            print(f"{key:42} {value}" + (f"   (target {target})" if target else ""))


if __name__ == "__main__":
    main()
