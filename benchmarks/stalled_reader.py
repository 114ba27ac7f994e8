"""A client that stops reading an SSE stream: what does it cost, and for how long?

Against a real uvicorn on 127.0.0.1 in this process (tokenbelt's protocol, as ``tokenbelt
serve`` runs it), serving the embedded default model: a raw socket client (the kernel's
default socket settings unless ``--client-rcvbuf``) asks for a long streamed completion,
reads nothing for ``--seconds`` (default 30), then reads what is left. Once a second it
samples the request's computed tokens (``trace.completion_tokens``) and this process's RSS.
Generation stops once the belt and the socket buffers are full; with a reader timeout
(``--reader-timeout``, default 10; 0 = none), the request then ends ``reader_timeout`` and
its connection is closed. With ``--reader-timeout 0`` and ``--client-rcvbuf 4096`` the
stream instead runs to its end once the client reads again.

Run: ``.venv/bin/python benchmarks/stalled_reader.py [--seconds 30] [--reader-timeout 10]
[--json]``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

import psutil
import uvicorn

import _harness
from tokenbelt import Runtime, ScriptedEngine, Trace, TraceEvent
from tokenbelt.models import default_model_path
from tokenbelt.server import ServerSettings, create_app, http_protocol


def main(argv: list[str] | None = None) -> int:
    parser = _harness.parser(__doc__)
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
    parser.add_argument(
        "--reader-timeout",
        type=float,
        default=10.0,
        help="seconds the socket may accept nothing before the stream ends (0: no limit)",
    )
    parser.add_argument(
        "--scripted-rate",
        type=float,
        default=0.0,
        help="serve a scripted model at this many tokens a second instead of the embedded "
        "model (a steady rate, for figures that do not depend on the CPU)",
    )
    args = _harness.parse(parser, argv)

    traces: list[Trace] = []

    def keep(event: TraceEvent) -> None:
        if event.kind == "enqueued":
            traces.append(event.trace)

    runtime = Runtime(keep_alive=None, observers=[keep])
    if args.scripted_rate:
        pieces = [f" w{i}" for i in range(args.max_tokens)]
        runtime.add_engines("scripted", [ScriptedEngine(pieces, delay=1 / args.scripted_rate)])
    else:
        runtime.load(str(default_model_path()))
    settings = ServerSettings(capacity=8, reader_timeout=args.reader_timeout or None)
    app = create_app(runtime, settings)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.send_buffer)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", http=http_protocol(settings.read_timeout))
    server = uvicorn.Server(config)
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
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
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
    with contextlib.suppress(ConnectionResetError):
        while True:  # read again, to the end (or to the close of an ended stream)
            chunk = client.recv(65536)
            received += len(chunk)
            if not chunk or b"data: [DONE]" in chunk[-64:]:
                break
    trace.wait_released(30)
    ended_s = None
    if trace.released is not None and trace.enqueued is not None:
        ended_s = round(trace.released - trace.enqueued, 1)
    # When the model stopped: the first sample of the plateau.
    stopped_at = next((s["t_s"] for s in samples if s["tokens"] == paused_at), None)
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
        "reader_timeout_s": args.reader_timeout or None,
        "client_rcvbuf": args.client_rcvbuf or "default",
        "model": f"scripted at {args.scripted_rate:g} tok/s" if args.scripted_rate else "embedded",
        "generation_stopped_by_s": stopped_at if not running_when_resumed else None,
        "released_after_s": ended_s,
        "rss_mb_first_sample": samples[0]["rss_mb"],
        "rss_mb_last_sample": samples[-1]["rss_mb"],
        "rss_growth_mb": round(samples[-1]["rss_mb"] - samples[0]["rss_mb"], 1),
        "max_tokens": args.max_tokens,
        "final_completion_tokens": trace.completion_tokens,
        "end_reason": trace.end_reason.value if trace.end_reason else None,
        "bytes_read_after_resuming": received,
        "samples": samples,
    }
    _harness.emit(out, args.json, print_table)
    return 0


def print_table(out: dict[str, Any]) -> None:
    print(f"{'t s':>6} {'tokens':>8} {'rss MB':>8}")
    for s in out["samples"]:
        print(f"{s['t_s']:>6} {s['tokens']:>8} {s['rss_mb']:>8}")
    for key in list(out)[:-1]:
        print(f"{key:<32} {out[key]}")


if __name__ == "__main__":
    raise SystemExit(main())
