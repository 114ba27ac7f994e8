"""Code completion while typing: ghost-text latency and stale work in three client patterns.

A real source file (tokenbelt's own ``engines/_infill.py``) is typed at a human rate (60 to
150 ms between keystrokes, a pause of 0.5 to 2 s every 10 to 25 keys; seeded), and a
completion is asked for at every keystroke on ``POST /infill`` (streamed, ``n_predict``
tokens, ``ignore_eos`` so that every completion costs the same), in three patterns:

1. ``serial`` (llama.vscode, llama.vim): one request in flight, never aborted; keystrokes
   that come meanwhile wait, and the latest is sent when it ends;
2. ``fire``: a request at every keystroke, none aborted, all with ``id_slot`` 0 (naive
   clients, proxies that pass no disconnect on): tokenbelt supersedes the older ones;
3. ``abort`` (Continue, Cody): the previous request is aborted (its connection closed)
   at every keystroke, with no ``id_slot``: the disconnect ends it.

At each pause (the keystroke whose completion the user reads) it reports the ghost-text
latency, keystroke to first token and to the completion's end, p50/p95; beside them the
same completions asked for alone on an idle server, nothing typed before them (``alone``).
From tokenbelt's traces (``/v1/requests``): the tokens computed for requests that went
stale (prompt tokens computed and tokens generated), the generated tokens past their stop
(after ``cancel_requested``, estimated from the decode rate), and the prefix-cache hits
per request.

With ``--llama-server PATH`` (built by ``benchmarks/build_llama_server.sh``) the same
replay runs against llama.cpp's own server too (same model file, threads and slots;
``--no-repack`` for this CPU's AMX); its traces are not known, only its latencies.

Run: ``.venv/bin/python benchmarks/completion.py [--json] [--keys N] [--cache-reuse N]
[--llama-server PATH]``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import _harness

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fimmodel import fim_model

SOURCE = Path(__file__).resolve().parent.parent / "src" / "tokenbelt" / "engines" / "_infill.py"
PATTERNS = ("serial", "fire", "abort")


def schedule(keys: int, seed: int) -> list[float]:
    """When each keystroke comes, in seconds from the start; a pause follows the last one."""
    rng = random.Random(seed)
    at, times, next_pause = 0.0, [], rng.randint(10, 25)
    for i in range(keys):
        times.append(at)
        if i + 1 == next_pause:
            at += rng.uniform(0.5, 2.0)
            next_pause += rng.randint(10, 25)
        else:
            at += rng.uniform(0.06, 0.15)
    return times


def pauses(times: list[float]) -> list[int]:
    """The keystrokes after which the typist pauses (and the last one)."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return [i for i, gap in enumerate(gaps) if gap >= 0.5] + [len(times) - 1]


def body(text: str, cursor: int, n_predict: int, slot: int) -> dict[str, Any]:
    head = text[:cursor]
    cut = head.rfind("\n") + 1
    return {
        "id_slot": slot,
        "input_prefix": head[:cut][-6000:],
        "prompt": head[cut:],
        "input_suffix": text[cursor : cursor + 1500],
        "n_predict": n_predict,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "cache_prompt": True,
    }


class Seen:
    """One request as the client saw it."""

    def __init__(self, key: int, sent: float) -> None:
        self.key = key
        self.sent = sent
        self.first: float | None = None
        self.end: float | None = None
        self.request_id: str | None = None


async def complete(client: httpx.AsyncClient, payload: dict[str, Any], seen: Seen) -> None:
    async with client.stream("POST", "/infill", json=payload) as r:
        seen.request_id = r.headers.get("x-request-id")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("stop"):
                seen.end = time.perf_counter()
            elif seen.first is None and event.get("content"):
                seen.first = time.perf_counter()


async def replay(url: str, pattern: str, text: str, start: int, args: Any) -> list[Seen]:
    times = schedule(args.keys, args.seed)
    slot = 0 if pattern in ("serial", "fire") else -1
    seen: list[Seen] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        t0 = time.perf_counter()
        running: asyncio.Task[None] | None = None
        pending: int | None = None
        tasks: list[asyncio.Task[None]] = []

        def send(key: int) -> asyncio.Task[None]:
            s = Seen(key, t0 + times[key])
            seen.append(s)
            payload = body(text, start + key + 1, args.n_predict, slot)
            task = asyncio.ensure_future(complete(client, payload, s))
            tasks.append(task)
            return task

        async def serial_drain() -> None:
            nonlocal running, pending
            while running is not None:
                await asyncio.wait([running])
                running = None
                if pending is not None:
                    key, pending = pending, None
                    running = send(key)

        drainer: asyncio.Task[None] | None = None
        for key, at in enumerate(times):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            if pattern == "serial":
                if running is None:
                    running = send(key)
                    drainer = asyncio.ensure_future(serial_drain())
                else:
                    pending = key
            else:
                if pattern == "abort" and running is not None and not running.done():
                    running.cancel()
                running = send(key)
        if drainer is not None:
            await drainer
        await asyncio.gather(*tasks, return_exceptions=True)
    return seen


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p95_ms": None}
    return {
        "p50_ms": round(_harness.percentile(values, 0.5) * 1000, 1),
        "p95_ms": round(_harness.percentile(values, 0.95) * 1000, 1),
    }


async def alone(
    url: str, text: str, start: int, keys: list[int], args: Any
) -> list[tuple[float, float]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for key in keys:
            payload = body(text, start + key + 1, args.n_predict, -1) | {"cache_prompt": False}
            s = Seen(key, time.perf_counter())
            await complete(client, payload, s)
            if s.first is not None and s.end is not None:
                out.append((s.first - s.sent, s.end - s.sent))
    return out


def traced(url: str, seen: list[Seen]) -> dict[str, Any]:
    """What tokenbelt's traces say of a replay's requests."""
    ids = {s.request_id for s in seen if s.request_id}
    listed = httpx.get(f"{url}/v1/requests", params={"limit": 1000}, timeout=30).json()
    traces = [
        t for t in listed.get("requests", listed.get("data", [])) if t.get("request_id") in ids
    ]
    stale = [t for t in traces if t["end_reason"] in ("superseded", "client_disconnect")]
    after = []
    for t in stale:
        line = t["timeline_ms"]
        rate = t.get("decode_tok_s") or 0.0
        if line.get("last_token") is not None and line.get("cancel_requested") is not None:
            late_ms = max(0.0, line["last_token"] - line["cancel_requested"])
            after.append(late_ms * rate / 1000)
    return {
        "requests": len(traces),
        "stale_requests": len(stale),
        "stale_prompt_tokens_computed": sum(t["prompt_tokens"] - t["cached_tokens"] for t in stale),
        "stale_tokens_generated": sum(t["completion_tokens"] for t in stale),
        "tokens_after_stop_per_stale_request": round(sum(after) / len(after), 2) if after else 0.0,
        "cancel_to_release_p95_ms": stats(
            [
                t["cancel_to_release_ms"] / 1000
                for t in stale
                if t["cancel_to_release_ms"] is not None
            ]
        )["p95_ms"],
        "cached_tokens_per_request": round(sum(t["cached_tokens"] for t in traces) / len(traces), 1)
        if traces
        else 0.0,
        "end_reasons": sorted({t["end_reason"] for t in traces}),
    }


def run_server(url: str, text: str, start: int, args: Any, with_traces: bool) -> dict[str, Any]:
    times = schedule(args.keys, args.seed)
    out: dict[str, Any] = {}
    points = pauses(times)
    base = asyncio.run(alone(url, text, start, points, args))
    out["alone"] = {"first": stats([f for f, _ in base]), "end": stats([e for _, e in base])}
    for pattern in PATTERNS:
        seen = asyncio.run(replay(url, pattern, text, start, args))
        t0 = min(s.sent for s in seen)
        key_at = {k: t0 + t for k, t in enumerate(times)}
        got = ghost_of(seen, points, key_at, pattern)
        row: dict[str, Any] = {
            "first": stats([f for f, _ in got]),
            "end": stats([e for _, e in got]),
            "sent": len(seen),
            "pauses_served": len(got),
        }
        if with_traces:
            row |= traced(url, seen)
        out[pattern] = row
    return out


def ghost_of(
    seen: list[Seen], points: list[int], key_at: dict[int, float], pattern: str
) -> list[tuple[float, float]]:
    """Per pause: keystroke to first token and to end, of the request that answered it
    (``serial``: the first one sent at or after it; else the one sent for it)."""
    out = []
    for p in points:
        if pattern == "serial":
            answering = [s for s in seen if s.key >= p]
        else:
            answering = [s for s in seen if s.key == p]
        done = [s for s in answering if s.first is not None and s.end is not None]
        if not done:
            continue
        s = min(done, key=lambda s: s.key)
        assert s.first is not None
        assert s.end is not None
        out.append((s.first - key_at[p], s.end - key_at[p]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--keys", type=int, default=80, help="keystrokes typed (default 80)")
    parser.add_argument("--n-predict", type=int, default=24, help="tokens a completion asks for")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--llama-server", default=None, help="llama-server binary to compare")
    parser.add_argument(
        "--cache-reuse",
        type=int,
        default=None,
        help="--cache-reuse for both servers (default: each one's own, tokenbelt 256, "
        "llama-server 0)",
    )
    args = _harness.parse(parser, argv)
    text = SOURCE.read_text()
    start = text.index("@dataclass(frozen=True)\nclass Infill")
    model = fim_model()
    common = {"keys": args.keys, "n_predict": args.n_predict, "seed": args.seed}
    reuse = [] if args.cache_reuse is None else ["--cache-reuse", str(args.cache_reuse)]
    common["cache_reuse"] = args.cache_reuse
    result: dict[str, Any] = {"model": model.name, "source": SOURCE.name, **common}
    port = _harness.free_port()
    command = [sys.executable, "-m", "tokenbelt", "serve", str(model), "--port", str(port)]
    command += ["--slots", str(args.slots), "--threads", str(args.threads), *reuse]
    with _harness.server_process(command, port) as url:
        result["tokenbelt"] = run_server(url, text, start, args, with_traces=True)
    if args.llama_server:
        port = _harness.free_port()
        command = [args.llama_server, "-m", str(model), "--port", str(port), "--no-repack"]
        command += ["-t", str(args.threads), "-np", str(args.slots), "-c", str(4096 * args.slots)]
        command += reuse
        with _harness.server_process(command, port) as url:
            result["llama_server"] = run_server(url, text, start, args, with_traces=False)
    _harness.emit(result, args.json, table)
    return 0


def table(result: dict[str, Any]) -> None:
    reuse = result["cache_reuse"]
    print(
        f"code completion while typing: {result['keys']} keys, n_predict {result['n_predict']}, "
        f"cache reuse {'each server default' if reuse is None else reuse}"
    )
    for server in ("tokenbelt", "llama_server"):
        if server not in result:
            continue
        rows = result[server]
        print(f"\n{server}")
        print(
            f"{'pattern':<8} {'first p50':>10} {'first p95':>10} {'end p50':>9} {'end p95':>9}"
            f" {'sent':>5} {'stale':>6} {'stale gen':>9} {'after stop':>10} {'cached/req':>10}"
        )
        for name in ("alone", *PATTERNS):
            r = rows[name]
            print(
                f"{name:<8} {r['first']['p50_ms']!s:>10} {r['first']['p95_ms']!s:>10}"
                f" {r['end']['p50_ms']!s:>9} {r['end']['p95_ms']!s:>9} {r.get('sent', '-')!s:>5}"
                f" {r.get('stale_requests', '-')!s:>6} {r.get('stale_tokens_generated', '-')!s:>9}"
                f" {r.get('tokens_after_stop_per_stale_request', '-')!s:>10}"
                f" {r.get('cached_tokens_per_request', '-')!s:>10}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
