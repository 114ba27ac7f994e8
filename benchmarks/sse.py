"""The HTTP service on the real default model: SSE overhead, and how fast a stop frees the model.

Two questions, each against a real uvicorn on 127.0.0.1 in this process:

- **sse_ratio**: decode tokens/s seen by an SSE client (``POST /v1/completions`` with
  ``stream: true``, timed per content chunk at the client, first to last), divided by a bare
  ``Llama.generate`` loop (plus ``detokenize``) on the *same* ``Llama`` object (the loaded
  engine's ``_llm``), with the same prompt tokens, seed and sampling. Runs are interleaved
  and the medians compared. Target: >= 0.97.
- **cancel to release**, p95 over HTTP, for three ways a client leaves: closing an SSE stream
  in decode, closing a non-streaming request in decode, and closing a stream during the
  prefill of a 2,000-token prompt. ``cancel_to_release`` is the server's own trace (the
  stop reached the belt -> the engine let go); ``close_to_release`` adds the time the server
  took to notice (the client's ``close()`` -> release, same monotonic clock). Target for
  ``cancel_to_release``: <= 50 ms.

When llama-cpp-python's server extra is importable (``llama_cpp.server.app``), the same cases
run against it as a peer column. It has no trace, so its release is observed from outside:
right after the close a one-token probe request is sent, and the model is taken as free
when the probe is answered (minus the probe's own latency on an idle server).

Run: ``.venv/bin/python benchmarks/sse.py [--json] [--trials N] [--tokens N]``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn

import _harness
from tokenbelt import Runtime
from tokenbelt.belt import Trace, TraceEvent
from tokenbelt.engines import GenerationRequest, LlamaEngine, SamplingParams, usable_cores
from tokenbelt.models import default_model_path
from tokenbelt.server import ServerSettings, create_app

TARGET_RATIO = 0.97
TARGET_MS = 50.0
PROMPT = "Once upon a time, in a village by the sea, there lived an old fisherman who"
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 200)
SAMPLING = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repeat_penalty": 1.0,
    "seed": 1234,
}
#: tokens decoded before a "leave during decode" client closes
DECODED_BEFORE_LEAVING = 4
#: max_tokens of the "leave during decode" requests: what a peer that never stops computes
DECODE_MAX_TOKENS = 256
#: a safety net for every wait
NET = 120.0


# -- serving ----------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """Run ``app`` on a real uvicorn in a thread; yields its base URL."""
    # proto IPPROTO_TCP: asyncio turns Nagle off only on sockets that say TCP.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False)
    config.timeout_graceful_shutdown = 5
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + NET
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(NET)
        sock.close()


class Traces:
    """A runtime observer: the server's trace of every request, in enqueue order."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.traces: list[Trace] = []

    def __call__(self, event: TraceEvent) -> None:
        with self.cond:
            if event.kind == "enqueued":
                self.traces.append(event.trace)
            self.cond.notify_all()

    def next_after(self, count: int) -> Trace:
        with self.cond:
            self.cond.wait_for(lambda: len(self.traces) > count, NET)
            return self.traces[count]


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + NET
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.0005)


class RawRequest:
    """A POST over a plain socket, so the benchmark controls exactly when it closes."""

    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=NET)
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + data)
        self.received = b""

    def read_events(self, count: int) -> None:
        while self.received.count(b"data: ") < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("the server closed the stream early")
            self.received += chunk

    def close(self) -> float:
        """Close the connection; returns the monotonic time of the close."""
        self.sock.close()
        return time.monotonic()


# -- measurements -----------------------------------------------------------------------------


def sse_rate(url: str, tokens: int, extra: dict[str, Any] | None = None) -> tuple[float, int]:
    """(content chunks/s between the first and the last chunk, chunks) for one SSE request."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "stream": True, **SAMPLING, **(extra or {})}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=NET) as response:
        response.raise_for_status()
        times = _harness.text_times(response.iter_lines())
    if len(times) < 2:
        raise RuntimeError("the SSE run produced fewer than two tokens")
    return (len(times) - 1) / (times[-1] - times[0]), len(times)


def bare_rate(engine: LlamaEngine, tokens: int) -> tuple[float, int]:
    """The same decode as a bare ``Llama.generate`` loop on the engine's own ``Llama``."""
    llm = engine._llm
    request = GenerationRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=tokens))
    prompt_tokens = engine.tokenize_request(request)
    llm.reset()
    llm.set_seed(SAMPLING["seed"])
    is_eog = engine._lib.llama_vocab_is_eog
    vocab = llm._model.vocab
    steps = llm.generate(
        prompt_tokens,
        top_k=SAMPLING["top_k"],
        top_p=SAMPLING["top_p"],
        min_p=SAMPLING["min_p"],
        temp=SAMPLING["temperature"],
        repeat_penalty=SAMPLING["repeat_penalty"],
    )
    times: list[float] = []
    try:
        for token in steps:
            if is_eog(vocab, token):
                break
            llm.detokenize([token])
            times.append(time.perf_counter())
            if len(times) >= tokens:
                break
    finally:
        steps.close()
    return (len(times) - 1) / (times[-1] - times[0]), len(times)


def p95(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


CASES = ("stream_disconnect", "nonstream_disconnect", "prefill_disconnect")


def leave(url: str, case: str, traces: Traces | None) -> tuple[float, Trace | None]:
    """Start one request, leave the way ``case`` says; returns (close time, server trace)."""
    seen = len(traces.traces) if traces else 0
    if case == "prefill_disconnect":
        body = {"prompt": LONG_PROMPT, "max_tokens": 8, "stream": True, **SAMPLING}
    else:
        stream = case == "stream_disconnect"
        body = {"prompt": PROMPT, "max_tokens": DECODE_MAX_TOKENS, "stream": stream, **SAMPLING}
    request = RawRequest(url, "/v1/completions", body)
    trace = traces.next_after(seen) if traces else None
    if case == "stream_disconnect":
        request.read_events(DECODED_BEFORE_LEAVING)
    elif trace is not None and case == "nonstream_disconnect":
        until(lambda: trace.completion_tokens >= DECODED_BEFORE_LEAVING, "tokens")
    elif trace is not None:
        until(lambda: trace.admitted is not None, "admission")
        time.sleep(0.1)  # well inside the prefill, which takes seconds
    else:  # the peer: no trace to watch, so give it time to be in the same phase
        time.sleep(0.6 if case == "nonstream_disconnect" else 0.3)
    return request.close(), trace


def paired(
    trials: int, sse: Callable[[], tuple[float, int]], bare: Callable[[], tuple[float, int]]
) -> dict[str, Any]:
    """Interleave SSE and bare runs in pairs, order alternating, so drift hits both alike."""
    rates: dict[str, list[float]] = {"sse": [], "bare": []}
    counts: set[int] = set()
    for i in range(trials):
        runs = [("sse", sse), ("bare", bare)]
        for side, run in runs if i % 2 == 0 else runs[::-1]:
            rate, n = run()
            rates[side].append(rate)
            counts.add(n)
    return {
        "sse_tok_s": statistics.median(rates["sse"]),
        "bare_tok_s": statistics.median(rates["bare"]),
        # Each pair ran back to back under the same machine load: the median of the
        # pairs' ratios is steadier than a ratio of medians when the load moves.
        "sse_ratio": statistics.median(
            a / b for a, b in zip(rates["sse"], rates["bare"], strict=True)
        ),
        "tokens_per_run": sorted(counts),
    }


def ours(runtime: Runtime, engine: LlamaEngine, trials: int, tokens: int) -> dict[str, Any]:
    traces = Traces()
    runtime.subscribe(traces)
    app = create_app(runtime, ServerSettings(), close_runtime=False)
    with serving(app) as url:
        sse_rate(url, 8)  # warm up both paths once
        bare_rate(engine, 8)
        result = paired(trials, lambda: sse_rate(url, tokens), lambda: bare_rate(engine, tokens))
        stops: dict[str, dict[str, list[float]]] = {}
        for case in CASES:
            c2r: list[float] = []
            close2r: list[float] = []
            for _ in range(trials):
                closed, trace = leave(url, case, traces)
                assert trace is not None
                if not trace.wait_released(NET):
                    raise RuntimeError(f"{case}: no release within {NET} s")
                if trace.end_reason is None or trace.end_reason.value != "client_disconnect":
                    raise RuntimeError(f"{case}: ended {trace.end_reason}")
                c2r.append((trace.cancel_to_release or 0.0) * 1000)
                close2r.append(((trace.released or closed) - closed) * 1000)
            stops[case] = {"cancel_to_release": c2r, "close_to_release": close2r}
    return {**result, "stops": stops}


# -- the peer: llama-cpp-python's own server ----------------------------------------------------


def peer_available() -> str | None:
    """None if ``llama_cpp.server.app`` imports, else why not."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except Exception as exc:
        return f"llama_cpp.server.app is not importable ({type(exc).__name__}: {exc})"
    return None


def peer(engine: LlamaEngine, trials: int, tokens: int) -> dict[str, Any]:
    """The same cases against llama-cpp-python's server (its own ``Llama`` of the same file)."""
    from llama_cpp.server.app import create_app as create_peer_app
    from llama_cpp.server.settings import ModelSettings
    from llama_cpp.server.settings import ServerSettings as PeerSettings

    model = ModelSettings(
        model=str(default_model_path()),
        n_ctx=4096,
        n_threads=engine._llm.n_threads,
        verbose=False,
    )
    from tokenbelt.engines import amx_safe

    with amx_safe():  # the weights as tokenbelt's engines load them
        app = create_peer_app(server_settings=PeerSettings(), model_settings=[model])
    probe = {"prompt": "Hi", "max_tokens": 1, "temperature": 0.0}
    with serving(app) as url, httpx.Client(timeout=NET) as client:

        def probe_latency() -> float:
            started = time.monotonic()
            client.post(f"{url}/v1/completions", json=probe).raise_for_status()
            return time.monotonic() - started

        sse_rate(url, 8)
        result = paired(trials, lambda: sse_rate(url, tokens), lambda: bare_rate(engine, tokens))
        idle = statistics.median(probe_latency() for _ in range(5))
        stops: dict[str, dict[str, list[float]]] = {}
        for case in CASES:
            free: list[float] = []
            # It keeps computing after a prefill disconnect: one run of that is enough.
            for _ in range(trials if case != "prefill_disconnect" else 1):
                closed, _ = leave(url, case, None)
                probe_latency()
                free.append(max(0.0, (time.monotonic() - closed - idle)) * 1000)
            stops[case] = {"close_to_free": free}
    return {**result, "stops": stops}


# -- report -----------------------------------------------------------------------------------


def summarise(trials: int, tokens: int) -> dict[str, Any]:
    runtime = Runtime(keep_alive=None, slots=1)
    try:
        # The single-context engine: one ``Llama`` serves both sides, so the comparison
        # isolates the HTTP layer's cost (the batch engine's ratio: engine.py, batch.py).
        cores = usable_cores()
        model = runtime.add_engines(
            "smollm2",
            lambda: [LlamaEngine(default_model_path(), n_threads=cores, n_threads_batch=cores)],
        )
        engine = model.engines[0]
        assert isinstance(engine, LlamaEngine)
        result = ours(runtime, engine, trials, tokens)
        out = report(result, trials, tokens, engine._llm.n_threads)
        why = peer_available()
        if why is not None:
            out["peer"] = {"name": "llama_cpp.server", "skipped": why}
        else:
            # It prints to stdout from its request handlers: keep --json output clean.
            with contextlib.redirect_stdout(sys.stderr):
                measured = peer(engine, min(trials, 3), tokens)
            out["peer"] = {
                "name": "llama_cpp.server",
                "sse_tok_s": round(measured["sse_tok_s"], 2),
                "bare_tok_s": round(measured["bare_tok_s"], 2),
                "sse_ratio": round(measured["sse_ratio"], 4),
                "close_to_free_p95_ms": {
                    k: round(p95(v["close_to_free"]), 2) for k, v in measured["stops"].items()
                },
            }
    finally:
        runtime.close()
    return out


def report(result: dict[str, Any], trials: int, tokens: int, threads: int) -> dict[str, Any]:
    c2r = {case: p95(v["cancel_to_release"]) for case, v in result["stops"].items()}
    close = {case: p95(v["close_to_release"]) for case, v in result["stops"].items()}
    return {
        "model": default_model_path().name,
        "threads": threads,
        "trials": trials,
        "tokens": tokens,
        "tokens_per_run": result["tokens_per_run"],
        "sse_tok_s": round(result["sse_tok_s"], 2),
        "bare_tok_s": round(result["bare_tok_s"], 2),
        "sse_ratio": round(result["sse_ratio"], 4),
        "sse_ratio_target": TARGET_RATIO,
        "cancel_to_release_p95_ms": {k: round(v, 2) for k, v in c2r.items()},
        "close_to_release_p95_ms": {k: round(v, 2) for k, v in close.items()},
        "cancel_to_release_target_ms": TARGET_MS,
        "meets_targets": result["sse_ratio"] >= TARGET_RATIO
        and all(v <= TARGET_MS for v in c2r.values()),
    }


def table(out: dict[str, Any]) -> str:
    peer = out["peer"]
    has_peer = "skipped" not in peer

    def row(name: str, value: str, peer_value: str = "", target: str = "") -> str:
        line = f"{name:<42} {value:>10}  {target:<9}"
        return line + (f" {peer_value:>18}" if has_peer else "")

    lines = [
        f"tokenbelt HTTP benchmark: {out['model']}, {out['threads']} llama.cpp thread(s), "
        f"{out['trials']} trials, tokens per run {out['tokens_per_run']}",
        row("", "tokenbelt", "llama_cpp.server", "target"),
        row(
            "SSE decode tok/s (client)",
            f"{out['sse_tok_s']:.1f}",
            f"{peer.get('sse_tok_s', 0):.1f}",
        ),
        row(
            "bare Llama.generate tok/s (paired runs)",
            f"{out['bare_tok_s']:.1f}",
            f"{peer.get('bare_tok_s', 0):.1f}",
        ),
        row(
            "sse_ratio",
            f"{out['sse_ratio']:.3f}",
            f"{peer.get('sse_ratio', 0):.3f}",
            f">= {TARGET_RATIO}",
        ),
    ]
    for case in CASES:
        lines.append(
            row(
                f"{case} cancel->release p95",
                f"{out['cancel_to_release_p95_ms'][case]:.1f} ms",
                f"{peer.get('close_to_free_p95_ms', {}).get(case, 0):.0f} ms (free)",
                f"<= {TARGET_MS:.0f} ms",
            )
        )
        close = out["close_to_release_p95_ms"][case]
        lines.append(row(f"{case} close->release p95", f"{close:.1f} ms"))
    if not has_peer:
        lines.append(f"peer column skipped: {peer['skipped']}")
    lines.append("meets targets: " + ("yes" if out["meets_targets"] else "NO"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--trials", type=int, default=7, help="runs per measurement")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per SSE/bare run")
    args = _harness.parse(parser, argv)
    out = summarise(max(1, args.trials), max(4, args.tokens))
    _harness.emit(out, args.json, lambda out: print(table(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
