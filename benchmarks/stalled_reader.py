"""A client that stops reading an SSE stream: does generation pause, and does memory stay flat?

Against a real uvicorn on 127.0.0.1 in this process, serving the embedded default model: a raw
socket client (small receive buffer) asks for a long streamed completion, reads nothing for
``--seconds`` (default 30), then reads everything. Once a second it samples the request's
computed tokens (``trace.completion_tokens``) and this process's RSS. Generation should stop
as soon as the belt and the socket buffers are full, memory should not grow, and the stream
should run to its end once the client reads again.

Run: ``.venv/bin/python benchmarks/stalled_reader.py [--seconds 30] [--json]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/http.py shares this folder: run as a script, the folder would lead sys.path
# and its http.py would hide the standard library's ``http`` package.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import socket
import threading
import time
from typing import Any

import psutil
import uvicorn

from tokenbelt import Runtime, Trace, TraceEvent
from tokenbelt.models import default_model_path
from tokenbelt.server import ServerSettings, create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long nobody reads")
    parser.add_argument("--max-tokens", type=int, default=3000, help="tokens asked for")
    parser.add_argument(
        "--send-buffer", type=int, default=32768, help="server socket SO_SNDBUF bytes"
    )
    parser.add_argument(
        "--client-rcvbuf",
        type=int,
        default=0,
        help="client socket SO_RCVBUF bytes (default 0: the kernel's default, autotuned)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    traces: list[Trace] = []

    def keep(event: TraceEvent) -> None:
        if event.kind == "enqueued":
            traces.append(event.trace)

    runtime = Runtime(keep_alive=None, observers=[keep])
    runtime.load(str(default_model_path()))
    app = create_app(runtime, ServerSettings(capacity=8))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.send_buffer)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    body = json.dumps(
        {
            "prompt": "Once upon a time",
            "max_tokens": args.max_tokens,
            "stream": True,
            "temperature": 0.0,
            "seed": 1,
        }
    ).encode()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if args.client_rcvbuf:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, args.client_rcvbuf)
    client.connect(("127.0.0.1", port))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    process = psutil.Process()
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        time.sleep(1.0)
        trace = traces[-1] if traces else None
        samples.append(
            {
                "t_s": round(time.monotonic() - start, 1),
                "tokens": trace.completion_tokens if trace else 0,
                "rss_mb": round(process.memory_info().rss / 2**20, 1),
            }
        )
    trace = traces[-1]
    paused_at = samples[-1]["tokens"]
    running_when_resumed = trace.end_reason is None
    received = 0
    client.settimeout(120)
    while True:  # read again, to the end
        chunk = client.recv(65536)
        received += len(chunk)
        if not chunk or b"data: [DONE]" in chunk[-64:]:
            break
    trace.wait_released(30)
    client.close()
    server.should_exit = True
    thread.join()
    runtime.close()

    half = len(samples) // 2
    out = {
        "seconds_not_reading": args.seconds,
        "tokens_at_1s": samples[0]["tokens"],
        "tokens_when_reading_resumed": paused_at,
        "still_running_when_resumed": running_when_resumed,
        "tokens_growth_second_half": samples[-1]["tokens"] - samples[half]["tokens"],
        "rss_mb_first_sample": samples[0]["rss_mb"],
        "rss_mb_last_sample": samples[-1]["rss_mb"],
        "rss_growth_mb": round(samples[-1]["rss_mb"] - samples[0]["rss_mb"], 1),
        "max_tokens": args.max_tokens,
        "final_completion_tokens": trace.completion_tokens,
        "end_reason": trace.end_reason.value if trace.end_reason else None,
        "bytes_read_after_resuming": received,
        "samples": samples,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'t s':>6} {'tokens':>8} {'rss MB':>8}")
        for s in samples:
            print(f"{s['t_s']:>6} {s['tokens']:>8} {s['rss_mb']:>8}")
        for key in list(out)[:-1]:
            print(f"{key:<32} {out[key]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
