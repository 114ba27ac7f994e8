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
Then the work each pattern cost the server: the prompt tokens it computed and the tokens
it generated, in all and for requests that went stale (a later keystroke came before
they ended: their answer was out of date), and the prompt tokens it found in its prefix
cache per request sent. tokenbelt's come from its traces (``/v1/requests``), with the
tokens computed past a stop (the trace's ``tokens_after_stop``: prompt tokens read and
tokens generated after ``cancel_requested``) and the stop-to-release p95; llama-server's
from its ``/metrics`` counters before and after the pattern (they count the work of
aborted requests too) less the ``timings`` of the requests that did not go stale (those
all run to their end).

With ``--llama-server PATH`` (built by ``benchmarks/build_llama_server.sh``) the same
replay runs against llama.cpp's own server too: same model file, threads, slots, context
per slot, flash attention "auto" and one unified KV cache, ``--no-repack`` where
tokenbelt keeps llama.cpp's plain weight layout (a CPU with AMX). Once for each
``--cache-reuse`` value (default 0 and 256; 0, llama-server's default, is off; the runs
are named ``llama-server`` and ``llama-server-reuseN``): after the first difference from
a slot's cached prompt, llama-server looks further on in the cache for the rest of the
new prompt, a chunk of at least N tokens, and shifts it into place. It skips cached
tokens that the new prompt lost; a keystroke changes the token at the difference (the
typed line), so within a line it finds no chunk, and both runs compute the same prompt
tokens there. tokenbelt's own ``--cache-reuse`` (``--tokenbelt-cache-reuse``, default its
own 256) also keeps a chunk that begins a few typed tokens further on.
Each server starts with an empty cache (tokenbelt's prefix cache is not read from disk).

Run: ``.venv/bin/python benchmarks/completion.py [--json] [--keys N] [--llama-server PATH]
[--cache-reuse N ...] [--tokenbelt-cache-reuse N]``.
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
#: every request on a connection of its own, on every server: llama-server drops a
#: kept-alive connection after a streamed answer now and then (the next request on it
#: fails with "Server disconnected"), and an editor's client may not keep one either
FRESH = httpx.Limits(max_connections=64, max_keepalive_connections=0)


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
        #: the final event's ``timings`` (``prompt_n``, ``predicted_n``, ``cache_n``)
        self.timings: dict[str, Any] = {}


async def complete(client: httpx.AsyncClient, payload: dict[str, Any], seen: Seen) -> None:
    async with client.stream("POST", "/infill", json=payload) as r:
        seen.request_id = r.headers.get("x-request-id")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("stop"):
                seen.end = time.perf_counter()
                seen.timings = event.get("timings") or {}
            elif seen.first is None and event.get("content"):
                seen.first = time.perf_counter()


async def replay(url: str, pattern: str, text: str, start: int, args: Any) -> list[Seen]:
    times = schedule(args.keys, args.seed)
    slot = 0 if pattern in ("serial", "fire") else -1
    seen: list[Seen] = []
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=FRESH) as client:
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
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=FRESH) as client:
        for key in keys:
            payload = body(text, start + key + 1, args.n_predict, -1) | {"cache_prompt": False}
            s = Seen(key, time.perf_counter())
            await complete(client, payload, s)
            if s.first is not None and s.end is not None:
                out.append((s.first - s.sent, s.end - s.sent))
    return out


def stale(seen: list[Seen], key_at: dict[int, float]) -> list[Seen]:
    """The requests that a later keystroke came before they ended (their answer out of
    date when it came), and those that never ended (aborted)."""
    out = []
    for s in seen:
        later = key_at.get(s.key + 1)
        if s.end is None or (later is not None and later < s.end):
            out.append(s)
    return out


def traced(url: str, seen: list[Seen], gone: list[Seen]) -> dict[str, Any]:
    """What tokenbelt's traces say of a replay's requests (``gone``: the stale ones)."""
    ids = {s.request_id for s in seen if s.request_id}
    stale_ids = {s.request_id for s in gone if s.request_id}
    listed = httpx.get(f"{url}/v1/requests", params={"limit": 1000}, timeout=30).json()
    traces = [
        t for t in listed.get("requests", listed.get("data", [])) if t.get("request_id") in ids
    ]
    old = [t for t in traces if t["request_id"] in stale_ids]
    stopped = [t for t in old if t["end_reason"] in ("superseded", "client_disconnect")]
    after = [t["tokens_after_stop"] for t in stopped]
    releases = [
        t["cancel_to_release_ms"] / 1000 for t in stopped if t["cancel_to_release_ms"] is not None
    ]
    return {
        "requests": len(traces),
        "prompt_tokens_computed": sum(_computed(t) for t in traces),
        "tokens_generated": sum(t["completion_tokens"] for t in traces),
        "stale_requests": len(old),
        "stale_prompt_tokens_computed": sum(_computed(t) for t in old),
        "stale_tokens_generated": sum(t["completion_tokens"] for t in old),
        "cached_tokens_per_request": _per(sum(t["cached_tokens"] for t in traces), len(traces)),
        "stopped_requests": len(stopped),
        "tokens_after_stop_per_stopped_request": _per(sum(after), len(after), 2),
        "stop_to_release_p95_ms": stats(releases)["p95_ms"],
        "end_reasons": sorted({t["end_reason"] for t in traces}),
    }


def _computed(trace: dict[str, Any]) -> int:
    return max(0, int(trace["prompt_tokens"]) - int(trace["cached_tokens"]))


def _per(total: float, n: int, digits: int = 1) -> float:
    return round(total / n, digits) if n else 0.0


#: llama-server's ``/metrics`` counters: prompt tokens computed (not those found in its
#: cache), those found in its cache, tokens generated; a request's work is counted when
#: its slot is released, aborted or not
COUNTERS = {
    "prompt": "llamacpp:prompt_tokens_total",
    "cached": "llamacpp:prompt_tokens_cached_total",
    "generated": "llamacpp:tokens_predicted_total",
}


def counters(url: str) -> dict[str, float]:
    """llama-server's work counters (``COUNTERS``), once no request is at work or waiting
    there (a stopped request's work is counted as its slot is released)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        values = {
            name: float(value)
            for name, _, value in (line.partition(" ") for line in text.splitlines())
            if name.startswith("llamacpp:")
        }
        busy = values["llamacpp:requests_processing"] + values["llamacpp:requests_deferred"]
        if busy == 0 or time.monotonic() > deadline:
            return {key: values[name] for key, name in COUNTERS.items()}
        time.sleep(0.05)


def counted(
    before: dict[str, float], after: dict[str, float], seen: list[Seen], gone: list[Seen]
) -> dict[str, Any]:
    """What llama-server's counters say of a replay: its work less that of the requests
    that did not go stale (each ran to its end, its ``timings`` read)."""
    work = {key: int(after[key] - before[key]) for key in COUNTERS}
    kept = [s for s in seen if s not in gone]
    return {
        "requests": len(seen),
        "prompt_tokens_computed": work["prompt"],
        "tokens_generated": work["generated"],
        "stale_requests": len(gone),
        "stale_prompt_tokens_computed": work["prompt"]
        - sum(int(s.timings.get("prompt_n", 0)) for s in kept),
        "stale_tokens_generated": work["generated"]
        - sum(int(s.timings.get("predicted_n", 0)) for s in kept),
        "cached_tokens_per_request": _per(work["cached"], len(seen)),
    }


def run_server(url: str, text: str, start: int, args: Any, tokenbelt: bool) -> dict[str, Any]:
    times = schedule(args.keys, args.seed)
    out: dict[str, Any] = {}
    points = pauses(times)
    base = asyncio.run(alone(url, text, start, points, args))
    out["alone"] = {"first": stats([f for f, _ in base]), "end": stats([e for _, e in base])}
    for pattern in PATTERNS:
        before = {} if tokenbelt else counters(url)
        seen = asyncio.run(replay(url, pattern, text, start, args))
        t0 = min(s.sent for s in seen)
        key_at = {k: t0 + t for k, t in enumerate(times)}
        got = ghost_of(seen, points, key_at, pattern)
        gone = stale(seen, key_at)
        row: dict[str, Any] = {
            "first": stats([f for f, _ in got]),
            "end": stats([e for _, e in got]),
            "sent": len(seen),
            "pauses_served": len(got),
        }
        if tokenbelt:
            row |= traced(url, seen, gone)
        else:
            row |= counted(before, counters(url), seen, gone)
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
    parser.add_argument("--n-ctx", type=int, default=4096, help="tokens per slot")
    parser.add_argument("--llama-server", default=None, help="llama-server binary to compare")
    parser.add_argument(
        "--cache-reuse",
        type=int,
        nargs="+",
        default=[0, 256],
        help="llama-server runs, one per value of its --cache-reuse (default 0 256)",
    )
    parser.add_argument(
        "--tokenbelt-cache-reuse",
        type=int,
        default=None,
        help="tokenbelt's --cache-reuse (default: its own, 256; 0: the shared prefix only)",
    )
    args = _harness.parse(parser, argv)
    text = SOURCE.read_text()
    start = text.index("@dataclass(frozen=True)\nclass Infill")
    model = fim_model()
    common = {"keys": args.keys, "n_predict": args.n_predict, "seed": args.seed}
    result: dict[str, Any] = {"model": model.name, "source": SOURCE.name, **common}
    result |= {"threads": args.threads, "slots": args.slots, "n_ctx": args.n_ctx}
    result["tokenbelt_cache_reuse"] = args.tokenbelt_cache_reuse
    runs: dict[str, dict[str, Any]] = {}
    port = _harness.free_port()
    command = [sys.executable, "-m", "tokenbelt", "serve", str(model), "--port", str(port)]
    command += ["--slots", str(args.slots), "--threads", str(args.threads)]
    command += ["--threads-batch", str(args.threads), "--n-ctx", str(args.n_ctx)]
    command += ["--prefix-cache-disk", "0"]
    if args.tokenbelt_cache_reuse is not None:
        command += ["--cache-reuse", str(args.tokenbelt_cache_reuse)]
    with _harness.server_process(command, port) as url:
        runs["tokenbelt"] = run_server(url, text, start, args, tokenbelt=True)
    for reuse in args.cache_reuse if args.llama_server else ():
        port = _harness.free_port()
        command = [args.llama_server, "-m", str(model), "--port", str(port), "--metrics"]
        command += ["-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.slots)]
        command += ["-c", str(args.n_ctx * args.slots), "-fa", "auto", "--kv-unified"]
        command += ["--cache-reuse", str(reuse), "--no-webui", *_harness.same_layout()]
        name = "llama-server" if reuse == 0 else f"llama-server-reuse{reuse}"
        with _harness.server_process(command, port) as url:
            runs[name] = run_server(url, text, start, args, tokenbelt=False)
    # Side by side: each pattern's row for every server.
    result["servers"] = list(runs)
    for pattern in ("alone", *PATTERNS):
        result[pattern] = {server: rows[pattern] for server, rows in runs.items()}
    _harness.emit(result, args.json, table)
    return 0


#: the table's columns: heading, width, the row's key
COLUMNS = (
    ("first p50", 9, "first.p50_ms"),
    ("first p95", 9, "first.p95_ms"),
    ("end p50", 8, "end.p50_ms"),
    ("end p95", 8, "end.p95_ms"),
    ("sent", 5, "sent"),
    ("computed", 8, "prompt_tokens_computed"),
    ("generated", 9, "tokens_generated"),
    ("stale", 5, "stale_requests"),
    ("stale pp", 8, "stale_prompt_tokens_computed"),
    ("stale gen", 9, "stale_tokens_generated"),
    ("cached/req", 10, "cached_tokens_per_request"),
    ("after stop", 10, "tokens_after_stop_per_stopped_request"),
)


def _cell(row: dict[str, Any], key: str) -> str:
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "-" if value is None else str(value)


def table(result: dict[str, Any]) -> None:
    print(
        f"code completion while typing: {result['keys']} keys, n_predict {result['n_predict']},"
        f" {result['threads']} threads, {result['slots']} slots of {result['n_ctx']} tokens"
    )
    print("ms from the keystroke at each pause; work in tokens (pp: prompt tokens computed)")
    width = max(len(s) for s in result["servers"])
    print(f"\n{'pattern':<8} {'server':<{width}}" + "".join(f" {h:>{w}}" for h, w, _ in COLUMNS))
    for pattern in ("alone", *PATTERNS):
        for server, row in result[pattern].items():
            cells = "".join(f" {_cell(row, key):>{w}}" for _, w, key in COLUMNS)
            print(f"{pattern:<8} {server:<{width}}{cells}")


if __name__ == "__main__":
    raise SystemExit(main())
