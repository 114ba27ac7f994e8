"""The Responses route beside chat completions: streamed tokens/s and cancel-to-release by id.

Against a real uvicorn on 127.0.0.1 in this process, serving the real default model with
the runtime's own engine (the batch engine, one slot busy at a time):

- **responses_ratio**: tokens/s an SSE client sees through ``POST /v1/responses``
  (timed per ``response.output_text.delta``, first to last) over the same request through
  ``POST /v1/chat/completions`` (timed per content chunk): same messages, seed, sampling
  and ``max_tokens``. Runs are paired, order alternating; the median of the pairs' ratios
  is reported. Target: >= 0.97.
- **cancel to release by id**, p95, through ``POST /v1/responses/{id}/cancel``, for a
  streamed, a blocking and a background response, each cancelled after a few tokens.
  ``cancel_to_release`` is the server's own trace (the stop reached the belt -> the
  engine let go). Target: <= one decode step (1 / the chat route's tokens/s) + 5 ms.

Run: ``.venv/bin/python benchmarks/responses.py [--json] [--trials N] [--tokens N]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from typing import Any

import httpx

import _harness
from sse import NET, Traces, p95, serving, until
from tokenbelt import Runtime
from tokenbelt.models import default_model_path
from tokenbelt.server import ServerSettings, create_app

TARGET_RATIO = 0.97
TARGET_SLACK_MS = 5.0
MESSAGES = [{"role": "user", "content": "Tell me a long story about an old fisherman."}]
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
#: tokens decoded before a response is cancelled
BEFORE_CANCEL = 4
CASES = ("streamed", "blocking", "background")


def _times(lines: Any, is_text: Any) -> list[float]:
    times = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]" and is_text(json.loads(line[6:])):
            times.append(time.perf_counter())
    return times


def _chat_text(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or []
    return bool(choices and choices[0].get("delta", {}).get("content"))


def _responses_text(event: dict[str, Any]) -> bool:
    return event.get("type") == "response.output_text.delta" and bool(event.get("delta"))


def rate(url: str, route: str, tokens: int) -> float:
    """Client-side tokens/s of one streamed request through ``route``."""
    if route == "chat":
        path, is_text = "/v1/chat/completions", _chat_text
        body = {"messages": MESSAGES, "max_tokens": tokens, "stream": True, **SAMPLING}
    else:
        path, is_text = "/v1/responses", _responses_text
        body = {"input": MESSAGES, "max_output_tokens": tokens, "stream": True, **SAMPLING}
    # Same prompt, seed and sampling: both routes decode the same tokens and stop alike.
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=NET) as response:
        response.raise_for_status()
        times = _times(response.iter_lines(), is_text)
    if len(times) < 2:
        raise RuntimeError(f"{route}: fewer than two tokens")
    return (len(times) - 1) / (times[-1] - times[0])


def cancel_once(url: str, case: str, traces: Traces) -> float:
    """Start a response, cancel it by id after a few tokens; the trace's cancel->release."""
    seen = len(traces.traces)
    body: dict[str, Any] = {"input": MESSAGES, "max_output_tokens": 2000, **SAMPLING}
    done = threading.Event()

    def run() -> None:
        try:
            if case == "streamed":
                with httpx.stream(
                    "POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=NET
                ) as r:
                    for _ in r.iter_lines():
                        pass
            else:
                extra = {"background": True} if case == "background" else {}
                httpx.post(f"{url}/v1/responses", json={**body, **extra}, timeout=NET)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    trace = traces.next_after(seen)
    until(lambda: trace.completion_tokens >= BEFORE_CANCEL, "tokens")
    response_id = "resp_" + trace.request_id.removeprefix("req_")
    httpx.post(f"{url}/v1/responses/{response_id}/cancel", timeout=NET).raise_for_status()
    if not trace.wait_released(NET):
        raise RuntimeError(f"{case}: no release within {NET} s")
    if trace.end_reason is None or trace.end_reason.value != "user_cancel":
        raise RuntimeError(f"{case}: ended {trace.end_reason}")
    done.wait(NET)
    thread.join(NET)
    return (trace.cancel_to_release or 0.0) * 1000


def summarise(trials: int, tokens: int) -> dict[str, Any]:
    runtime = Runtime(keep_alive=None)
    runtime.load(str(default_model_path()))
    traces = Traces()
    runtime.subscribe(traces)
    app = create_app(runtime, ServerSettings(responses_store_bytes=16 << 20))
    rates: dict[str, list[float]] = {"chat": [], "responses": []}
    stops: dict[str, list[float]] = {case: [] for case in CASES}
    with serving(app) as url:
        rate(url, "chat", 8)  # warm both paths once
        rate(url, "responses", 8)
        for i in range(trials):
            order = ("chat", "responses") if i % 2 == 0 else ("responses", "chat")
            for route in order:
                rates[route].append(rate(url, route, tokens))
        for case in CASES:
            for _ in range(trials):
                stops[case].append(cancel_once(url, case, traces))
    chat = statistics.median(rates["chat"])
    step_ms = 1000 / chat
    ratio = statistics.median(a / b for a, b in zip(rates["responses"], rates["chat"], strict=True))
    cancels = {case: round(p95(v), 2) for case, v in stops.items()}
    target_ms = step_ms + TARGET_SLACK_MS
    return {
        "model": default_model_path().name,
        "trials": trials,
        "tokens": tokens,
        "chat_tok_s": round(chat, 2),
        "responses_tok_s": round(statistics.median(rates["responses"]), 2),
        "responses_ratio": round(ratio, 4),
        "responses_ratio_target": TARGET_RATIO,
        "step_ms": round(step_ms, 2),
        "cancel_to_release_p95_ms": cancels,
        "cancel_to_release_target_ms": round(target_ms, 2),
        "meets_targets": ratio >= TARGET_RATIO and all(v <= target_ms for v in cancels.values()),
    }


def table(out: dict[str, Any]) -> None:
    rows = [
        ("chat completions SSE tok/s", f"{out['chat_tok_s']:.1f}", ""),
        ("responses SSE tok/s", f"{out['responses_tok_s']:.1f}", ""),
        ("responses_ratio", f"{out['responses_ratio']:.3f}", f">= {TARGET_RATIO}"),
        ("one decode step", f"{out['step_ms']:.1f} ms", ""),
    ]
    target = f"<= {out['cancel_to_release_target_ms']:.1f} ms"
    for case, value in out["cancel_to_release_p95_ms"].items():
        rows.append((f"{case}: cancel by id -> release p95", f"{value:.1f} ms", target))
    title = (
        f"tokenbelt Responses benchmark: {out['model']}, {out['trials']} trials, "
        f"{out['tokens']} tokens per run"
    )
    _harness.print_measures(title, rows, 40, 12)
    print("meets targets: " + ("yes" if out["meets_targets"] else "NO"))


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
    parser.add_argument("--trials", type=int, default=7, help="runs per measurement")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per streamed run")
    args = _harness.parse(parser, argv)
    out = summarise(max(1, args.trials), max(4, args.tokens))
    _harness.emit(out, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
