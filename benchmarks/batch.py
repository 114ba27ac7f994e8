"""Many streams on one model: tokenbelt's batched SDK streams against a bare batched loop.

Side by side in one process, on the embedded default model, greedy, same prompt:

- **bare**: the loop a user would write on llama-cpp-python's low-level API: one context
  (the same parameters as tokenbelt's: unified KV, ``n_seq_max`` = B), B copies of the
  prompt evaluated in one batch, then one ``llama_decode`` per step with one token per
  sequence, each sampled greedily from its own logits row, until every sequence ends
  (end of generation or ``--tokens``). It runs at the best thread count for B, found by
  trying every count from 1 to the cores this process may use (``threads_bare_{B}``).
- **tokenbelt**: B concurrent ``model.stream(...)`` calls on a runtime with B slots
  (``Runtime(slots=B)``), each read to the end on a thread of its own; thread counts are
  tokenbelt's defaults (adaptive, see ``engines/llama/_threads.py``).

Both rates are total tokens over wall time from the first call to the last token, so
prefill counts on both sides alike. Each side runs in a process of its own (one OpenMP
team per process, as in real use: see ``_side``); rounds alternate bare/tokenbelt,
``--rounds`` pairs; medians are reported. Then, with four streams:

- ``cancel_release_in_batch_p95_ms``: one of four running streams is cancelled at a random
  point; trace cancel-to-release (target: one batched step + 5 ms);
- ``step_ms_4``: wall time per batched step while four streams decode;
- ``max_gap_during_prefill_ms``: three streams decode while a ~1,200-token prompt arrives;
  the largest gap between two tokens of the running streams during its prefill.

When ``llama_cpp.server`` is importable (llama-cpp-python's own server, a test extra),
it serves four concurrent streaming requests on 127.0.0.1 at the bare loop's best thread
count and its aggregate rate is printed beside (``--no-peer`` skips it).

Targets (issue 10): ``batch_ratio_4 >= 0.90``; ``speedup_4`` > 1; cancel p95 within one
step + 5 ms.

Run: ``.venv/bin/python benchmarks/batch.py [--rounds N] [--tokens N] [--no-peer] [--json]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import _harness
from tokenbelt import Runtime
from tokenbelt.engines import BatchEngine, Message, usable_cores
from tokenbelt.models import default_model_path

SIZES = (1, 2, 4, 8)
SEA: list[Message] = [{"role": "user", "content": "Tell me about the sea and its storms."}]
_WORDS = ["the", "sea", "is", "wide", "and", "deep", "blue", "under", "a", "grey", "sky"]


class Bare:
    """A bare batched decode loop on its own context (same parameters as tokenbelt's)."""

    def __init__(self, path: str, sequences: int, n_ctx: int) -> None:
        import llama_cpp
        from llama_cpp import _internals

        from tokenbelt.engines import model_params, quiet_native_logs

        quiet_native_logs()  # llama.cpp's own log lines to logging, as the engine does
        self.lib: Any = llama_cpp
        self.model: Any = _internals.LlamaModel(
            path_model=path, params=model_params(), verbose=False
        )
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = sequences * n_ctx
        p.n_batch = p.n_ubatch = 512
        p.n_seq_max = sequences
        p.kv_unified = True
        p.flash_attn_type = 0
        self.ctx: Any = _internals.LlamaContext(model=self.model, params=p, verbose=False)
        self.mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.vocab = self.model.vocab

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.ctx.close()
        self.model.close()

    def run(
        self, prompt: list[int], sequences: int, tokens: int, threads: int
    ) -> tuple[int, float]:
        """(tokens generated, seconds) for ``sequences`` copies of ``prompt``."""
        lib, b = self.lib, self.batch
        lib.llama_memory_clear(self.mem, True)
        lib.llama_set_n_threads(self.ctx.ctx, threads, threads)
        samplers = [lib.llama_sampler_init_greedy() for _ in range(sequences)]
        started = time.perf_counter()
        n = 0
        rows: list[int] = []
        for s in range(sequences):
            for j, t in enumerate(prompt):
                b.token[n], b.pos[n], b.n_seq_id[n] = t, j, 1
                b.seq_id[n][0] = s
                b.logits[n] = j == len(prompt) - 1
                n += 1
            rows.append(n - 1)
        b.n_tokens = n
        assert lib.llama_decode(self.ctx.ctx, b) == 0
        live = list(range(sequences))
        pos = len(prompt)
        made = 0
        for _ in range(tokens):
            nxt = []
            for s, row in zip(live, rows, strict=True):
                t = lib.llama_sampler_sample(samplers[s], self.ctx.ctx, row)
                made += 1
                if not lib.llama_vocab_is_eog(self.vocab, t):
                    nxt.append((s, t))
            if not nxt or made >= tokens * sequences:
                break
            for i, (s, t) in enumerate(nxt):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos, 1, 1
                b.seq_id[i][0] = s
            b.n_tokens = len(nxt)
            live, rows = [s for s, _ in nxt], list(range(len(nxt)))
            pos += 1
            assert lib.llama_decode(self.ctx.ctx, b) == 0
        elapsed = time.perf_counter() - started
        for smpl in samplers:
            lib.llama_sampler_free(smpl)
        return made, elapsed


def tokenbelt_run(model: Any, sequences: int, tokens: int) -> tuple[int, float]:
    streams = [model.stream(SEA, max_tokens=tokens, temperature=0.0) for _ in range(sequences)]
    readers = [threading.Thread(target=s.read) for s in streams]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    elapsed = max(s.trace.last_token for s in streams) - min(s.trace.enqueued for s in streams)
    return sum(s.trace.completion_tokens for s in streams), elapsed


def best_threads(bare: Bare, prompt: list[int], sequences: int, tokens: int) -> int:
    rates = {}
    for threads in range(1, usable_cores() + 1):
        made, seconds = bare.run(prompt, sequences, min(tokens, 48), threads)
        rates[threads] = made / seconds
    return max(rates, key=rates.__getitem__)


def cancels_in_batch(model: Any, rounds: int, rng: random.Random) -> list[float]:
    out = []
    for _ in range(rounds):
        streams = [model.stream(SEA, max_tokens=400, temperature=0.0) for _ in range(4)]
        readers = [threading.Thread(target=s.read) for s in streams[1:]]
        for t in readers:
            t.start()
        victim = streams[0]
        pieces = iter(victim)
        for _ in range(rng.randrange(3, 12)):
            next(pieces)
        time.sleep(rng.random() * 0.03)
        victim.cancel()
        victim.wait_released(30)
        out.append((victim.trace.cancel_to_release or 0.0) * 1000)
        for s in streams[1:]:
            s.cancel()
        for t in readers:
            t.join()
    return out


def gap_during_prefill(model: Any) -> tuple[float, float]:
    running = [model.stream(SEA, max_tokens=400, temperature=0.0) for _ in range(3)]
    readers = [threading.Thread(target=s.read) for s in running]
    for t in readers:
        t.start()
    while not all(s.trace.completion_tokens >= 5 for s in running):
        time.sleep(0.005)
    long = model.stream(prompt=" ".join(_WORDS[i % len(_WORDS)] for i in range(1200)), max_tokens=2)
    long.read()
    admitted, first = long.trace.admitted or 0.0, long.trace.first_token or 0.0
    for s in running:
        s.cancel()
    for t in readers:
        t.join()
    gaps = []
    for s in running:
        times = [s.trace.first_token or 0.0]
        for g in s.trace.token_gaps:
            times.append(times[-1] + g)
        gaps += [b - a for a, b in itertools.pairwise(times) if b > admitted and a < first]
    return max(gaps, default=0.0) * 1000, (first - admitted) * 1000


def peer(tokens: int, threads: int) -> float | None:
    """Aggregate tok/s of llama-cpp-python's own server with four concurrent streams."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None
    import socket
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # (weights in the plain CPU layout, as tokenbelt loads them: see ``model_params``)
    launch = "import llama_cpp.llama_cpp as c; from tokenbelt.engines import model_params; "
    launch += "c.llama_model_default_params = model_params; "
    launch += "from llama_cpp.server.__main__ import main; main()"
    cmd = [sys.executable, "-c", launch, "--model", str(default_model_path())]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads)]
    # By default a new request cuts the running stream short: four at once would be
    # four interruptions, not four streams. This way it serves them one after another.
    cmd += ["--n_threads_batch", str(threads), "--interrupt_requests", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                return None  # it could not start (a dependency of its own is missing)
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            return None
        counts = [0] * 4

        def one(i: int) -> None:
            body = {"messages": SEA, "max_tokens": tokens, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        counts[i] += 1

        started = time.perf_counter()
        workers = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        return sum(counts) / (time.perf_counter() - started)
    finally:
        proc.terminate()
        proc.wait(10)


def side_bare(tokens: int) -> dict[str, Any]:
    """One round of the bare loop at every size, each at its best thread count."""
    path = str(default_model_path())
    out: dict[str, Any] = {}
    for b in SIZES:
        bare = Bare(path, b, 2048)
        prompt = list(bare.model.tokenize(_chat_prompt(bare.model).encode(), False, True))
        threads = best_threads(bare, prompt, b, tokens)
        made, seconds = bare.run(prompt, b, tokens, threads)
        out[str(b)] = {"tok_s": made / seconds, "threads": threads}
        bare.close()
    return out


def side_tokenbelt(tokens: int) -> dict[str, Any]:
    """One round of tokenbelt's SDK streams at every size (default thread counts)."""
    path = str(default_model_path())
    out: dict[str, Any] = {}
    for b in SIZES:
        with Runtime(slots=b, keep_alive=None, n_ctx=2048) as rt:
            model = rt.load(path)
            tokenbelt_run(model, b, 16)  # warm up: page the weights in, let the tuner look
            made, seconds = tokenbelt_run(model, b, tokens)
            engine = model.engines[0]
            assert isinstance(engine, BatchEngine)
            out[str(b)] = {"tok_s": made / seconds, "threads": engine.threads}
    return out


def _chat_prompt(model: Any) -> str:
    from tokenbelt.engines import chat_formatter

    result = chat_formatter(model)(messages=SEA)
    return str(result.prompt)


def _side(side: str, tokens: int) -> dict[str, Any]:
    """One side's round in a process of its own.

    llama.cpp's OpenMP threads form one team per calling thread; with two teams in one
    process (the bare loop's caller and the engine's loop thread) libgomp counts more
    threads than cores and stops spinning at its barriers, which slows single-token
    steps of both sides by half. Apart, each side runs as it would alone.
    """
    cmd = [sys.executable, __file__, "--side", side, "--tokens", str(tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    out: dict[str, Any] = {"tokens": args.tokens, "rounds": args.rounds}
    rounds: dict[str, list[dict[str, Any]]] = {"bare": [], "tokenbelt": []}
    for i in range(args.rounds):
        order = ["bare", "tokenbelt"] if i % 2 == 0 else ["tokenbelt", "bare"]
        for side in order:
            rounds[side].append(_side(side, args.tokens))
    for b in SIZES:
        for side in ("bare", "tokenbelt"):
            rates = [r[str(b)]["tok_s"] for r in rounds[side]]
            out[f"{side}_tok_s_{b}"] = round(statistics.median(rates), 1)
            out[f"threads_{side}_{b}"] = rounds[side][-1][str(b)]["threads"]
    with Runtime(slots=4, keep_alive=None, n_ctx=2048) as rt:
        model = rt.load(str(default_model_path()))
        engine = model.engines[0]
        assert isinstance(engine, BatchEngine)
        tokenbelt_run(model, 4, 16)
        before = engine.statistics()
        started = time.perf_counter()
        tokenbelt_run(model, 4, args.tokens)
        steps = engine.statistics().steps - before.steps
        out["step_ms_4"] = round((time.perf_counter() - started) * 1000 / steps, 2)
        cancels = sorted(cancels_in_batch(model, args.cancels, rng))
        out["cancel_release_in_batch_p95_ms"] = round(_harness.percentile(cancels, 0.95), 2)
        out["cancel_release_in_batch_max_ms"] = round(cancels[-1], 2)
        gap, prefill = gap_during_prefill(model)
        out["max_gap_during_prefill_ms"] = round(gap, 1)
        out["long_prefill_ms"] = round(prefill, 1)
        out["prefill_chunk"] = engine.config.prefill_chunk
        out["threads"] = engine.threads
    out["batch_ratio_4"] = round(out["tokenbelt_tok_s_4"] / out["bare_tok_s_4"], 3)
    out["batch_ratio_1"] = round(out["tokenbelt_tok_s_1"] / out["bare_tok_s_1"], 3)
    out["speedup_4"] = round(out["tokenbelt_tok_s_4"] / out["tokenbelt_tok_s_1"], 3)
    out["peer_llama_cpp_server_tok_s_4"] = (
        round(p, 1) if args.peer and (p := peer(args.tokens, out["threads_bare_1"])) else None
    )
    return out


def print_table(r: dict[str, Any]) -> None:
    print(f"{'streams':>8} {'bare tok/s':>11} {'tokenbelt tok/s':>16} {'ratio':>6} {'threads':>8}")
    # threads: the bare loop's best count / the count tokenbelt's tuner ended with
    for b in SIZES:
        bare, ours = r[f"bare_tok_s_{b}"], r[f"tokenbelt_tok_s_{b}"]
        threads = f"{r[f'threads_bare_{b}']}/{r[f'threads_tokenbelt_{b}']}"
        print(f"{b:>8} {bare:>11} {ours:>16} {ours / bare:>6.3f} {threads:>8}")
    keys = ("batch_ratio_4", "speedup_4", "step_ms_4", "cancel_release_in_batch_p95_ms")
    keys += ("max_gap_during_prefill_ms", "long_prefill_ms", "prefill_chunk", "threads")
    _harness.print_keys(r, (*keys, "peer_llama_cpp_server_tok_s_4"), 32)


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="bare/tokenbelt pairs per size")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--cancels", type=int, default=20, help="cancels in a batch of four")
    parser.add_argument(
        "--no-peer", dest="peer", action="store_false", help="skip llama_cpp.server"
    )
    parser.add_argument("--side", choices=["bare", "tokenbelt"], help=argparse.SUPPRESS)
    args = _harness.parse(parser, argv)
    if args.side is not None:  # one side's round, in a process of its own (see _side)
        side = side_bare if args.side == "bare" else side_tokenbelt
        print(json.dumps(side(args.tokens)))
        return 0
    if args.rounds < 1 or args.tokens < 2 or args.cancels < 1:
        parser.error("--rounds and --cancels must be >= 1, --tokens >= 2")
    _harness.emit(run(args), args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
