"""Benchmark clients as checks: guidellm and llama-benchy against a real ``tokenbelt serve``.

Both tools are driven from outside, as their users run them, for a short bounded run on the
default model; each must finish with every request answered (no error, nothing refused).
They send what vLLM- and llama.cpp-oriented clients send (``stream_options.
continuous_usage_stats``, ``ignore_eos``, ``min_tokens``, ``return_token_ids``,
``cache_prompt``): before tokenbelt did these, every request of both was a 400.

Nothing is downloaded: the tokenizer both need is built from the GGUF's own vocabulary
(``transformers`` reads GGUF), guidellm's prompts are synthetic, and llama-benchy's "book"
is this repository's README served from 127.0.0.1.

The tools have heavy dependencies (torch, transformers), so they live in a venv of their
own, never the project's::

    python3 -m venv /tmp/benchclients
    /tmp/benchclients/bin/pip install guidellm llama-benchy gguf
    python scripts/bench_clients/run.py --venv /tmp/benchclients

Run with the project's Python (it starts ``python -m tokenbelt serve``). Exit status 0
when both tools completed with zero errors; a JSON record of what happened goes to
``--out``. The counts are small on purpose (a check, not a measurement): raise
``--requests``/``--runs`` on a quiet machine for figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: a net for the server's start and for each tool's run, never the check itself
START_S = 120.0
#: the environment of every tool: no network beyond 127.0.0.1, no telemetry
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as answer:
        body = answer.read().decode()
    return json.loads(body) if body.lstrip().startswith(("{", "[")) else body


@contextlib.contextmanager
def tokenbelt_serve(log: Path, extra: list[str]) -> Iterator[str]:
    """``tokenbelt serve`` (the default model) on 127.0.0.1 until the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "tokenbelt", "serve", "--port", str(port), *extra]
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_S
        while True:
            if server.poll() is not None:
                raise SystemExit(f"tokenbelt serve exited: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError, ValueError):
                if get(f"{url}/health").get("status") == "ok":
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"tokenbelt serve not ready after {START_S} s")
            time.sleep(0.25)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextlib.contextmanager
def book_server(text: str) -> Iterator[str]:
    """The text llama-benchy cuts its prompts from, at a 127.0.0.1 address."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "book.txt").write_text(text, "utf-8")

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return None

        handler = functools.partial(Quiet, directory=folder)
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}/book.txt"
        finally:
            httpd.shutdown()
            httpd.server_close()
            thread.join()


def build_tokenizer(venv: Path, gguf: Path, target: Path) -> Path:
    """A Hugging Face tokenizer made from the GGUF's vocabulary (once; kept at ``target``)."""
    if (target / "tokenizer.json").is_file():
        return target
    code = (
        "import sys; from pathlib import Path; from transformers import AutoTokenizer; "
        "p = Path(sys.argv[1]); "
        "tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name); "
        "tok.save_pretrained(sys.argv[2])"
    )
    subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, str(gguf), str(target)],
        check=True,
        timeout=900,
        env={**os.environ, **OFFLINE},
    )
    return target


def run_tool(command: list[str], log: Path, timeout: float) -> int:
    with log.open("w") as out:
        done = subprocess.run(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
            env={**os.environ, **OFFLINE},
        )
    return done.returncode


def guidellm(
    args: argparse.Namespace, url: str, model: str, tokenizer: Path, work: Path
) -> dict[str, Any]:
    """Streaming chat completions of synthetic prompts, a fixed output length."""
    report = work / "guidellm.json"
    command = [
        str(args.venv / "bin" / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={url},model={model}",
        "--profile",
        f"kind=concurrent,streams={args.concurrency}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    rc = run_tool(command, work / "guidellm.log", args.timeout)
    result: dict[str, Any] = {"tool": "guidellm", "exit_status": rc}
    if report.is_file():
        bench = json.loads(report.read_text())["benchmarks"][0]
        state = bench["scheduler_state"]
        result["successful"] = state.get("successful_requests")
        result["errored"] = state.get("errored_requests")
        result["cancelled"] = state.get("cancelled_requests")
        result["incomplete"] = state.get("incomplete_requests")
        result["figures"] = guidellm_figures(bench)
    result["ok"] = (
        rc == 0 and result.get("successful") == args.requests and not result.get("errored")
    )
    return result


def guidellm_figures(bench: dict[str, Any]) -> dict[str, float]:
    """guidellm's own measures of a run (its report's first benchmark): output tokens/s
    over the measured span, time to first token and inter-token latency (ms)."""
    metrics = bench["metrics"]

    def successful(name: str) -> dict[str, Any]:
        found: dict[str, Any] = metrics[name]["successful"]
        return found

    ttft, itl = successful("time_to_first_token_ms"), successful("inter_token_latency_ms")
    return {
        "tok_s": round(successful("output_token_count")["total_sum"] / bench["duration"], 1),
        "ttft_p50_ms": round(ttft["median"], 1),
        "ttft_p95_ms": round(ttft["percentiles"]["p95"], 1),
        "itl_p50_ms": round(itl["median"], 2),
        "itl_p95_ms": round(itl["percentiles"]["p95"], 2),
    }


def llama_benchy(
    args: argparse.Namespace, url: str, model: str, tokenizer: Path, work: Path, book: str
) -> dict[str, Any]:
    """Prompt processing and generation runs: token ids on every chunk, an exact output
    length (``min_tokens`` + ``ignore_eos``), and ``cache_prompt: false``."""
    report = work / "llama-benchy.json"
    command = [
        str(args.venv / "bin" / "llama-benchy"),
        "--base-url",
        f"{url}/v1",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--pp",
        str(args.prompt_tokens),
        "--tg",
        str(args.output_tokens),
        "--runs",
        str(args.runs),
        "--concurrency",
        str(args.concurrency),
        "--book-url",
        book,
        "--latency-mode",
        "none",
        "--skip-coherence",
        "--exact-tg",
        "--no-cache",
        "--exit-on-first-fail",
        "--format",
        "json",
        "--save-result",
        str(report),
    ]
    rc = run_tool(command, work / "llama-benchy.log", args.timeout)
    result: dict[str, Any] = {"tool": "llama-benchy", "exit_status": rc}
    log = (work / "llama-benchy.log").read_text(errors="replace")
    # It counts tokens from token_ids when every chunk has them; otherwise it says so.
    result["fell_back_from_token_ids"] = "No complete token_ids" in log or "No token_ids" in log
    if report.is_file():
        bench = json.loads(report.read_text())["benchmarks"]
        result["benchmarks"] = [
            {
                "prompt_size": b["prompt_size"],
                "response_size": b["response_size"],
                "pp_tok_s": round(b["pp_throughput"]["mean"], 2),
                "tg_tok_s": round(b["tg_throughput"]["mean"], 2),
            }
            for b in bench
        ]
    result["ok"] = rc == 0 and report.is_file() and not result["fell_back_from_token_ids"]
    return result


_SERIES = re.compile(r"^(tokenbelt_requests_total|tokenbelt_refused_requests_total)\{(.*)\} (\S+)$")


def server_counts(url: str) -> dict[str, float]:
    """What the server counted: requests by end reason, and refusals."""
    counts: dict[str, float] = {}
    for line in str(get(f"{url}/metrics")).splitlines():
        found = _SERIES.match(line)
        if found:
            key = f"{found[1]}{{{found[2]}}}"
            counts[key] = counts.get(key, 0.0) + float(found[3])
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/benchclients"))
    parser.add_argument("--only", choices=("guidellm", "llama-benchy"))
    parser.add_argument("--requests", type=int, default=4, help="guidellm: requests in the run")
    parser.add_argument("--runs", type=int, default=2, help="llama-benchy: runs per test")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per tool")
    parser.add_argument("--out", type=Path, default=ROOT / "test-artifacts" / "bench-clients.json")
    parser.add_argument("serve_args", nargs="*", help="more flags for tokenbelt serve (after --)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    from tokenbelt.models import default_model_path

    gguf = Path(default_model_path())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    tokenizer = build_tokenizer(
        args.venv, gguf, Path(tempfile.gettempdir()) / f"tokenizer-{gguf.stem}"
    )
    results: list[dict[str, Any]] = []
    with tokenbelt_serve(work / "serve.log", args.serve_args) as url:
        model = get(f"{url}/v1/models")["data"][0]["id"]
        if args.only in (None, "guidellm"):
            results.append(guidellm(args, url, model, tokenizer, work))
        if args.only in (None, "llama-benchy"):
            with book_server((ROOT / "README.md").read_text() * 2) as book:
                results.append(llama_benchy(args, url, model, tokenizer, work, book))
        counts = server_counts(url)
    refused = sum(v for k, v in counts.items() if k.startswith("tokenbelt_refused"))
    record = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": gguf.name,
        "settings": {k: v for k, v in vars(args).items() if k not in ("venv", "out")},
        "results": results,
        "server": counts,
        "refused": refused,
        "logs": str(work),
    }
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    for r in results:
        sys.stdout.write(json.dumps(r) + "\n")
    sys.stdout.write(f"refused by the server: {refused:g}; record: {args.out}; logs: {work}\n")
    return 0 if results and all(r["ok"] for r in results) and refused == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
