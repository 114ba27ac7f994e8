"""A real HTTP file server for download tests: Range support, stalls, drops, a request log.

Runs ``http.server.ThreadingHTTPServer`` on 127.0.0.1 (ephemeral port) in a thread.
Every knob is per file and one-shot where that makes a scenario simple to write.
"""

from __future__ import annotations

import bisect
import hashlib
import http.server
import itertools
import threading
from dataclasses import dataclass, field
from types import TracebackType

SAFETY = 20.0  # seconds: a net for waits inside the server, never the assertion


@dataclass
class Served:
    data: bytes
    #: honour Range requests (206); False answers every GET with the whole file (200)
    ranges: bool = True
    #: answer with this status and no body (404, 500...)
    status: int = 200
    #: one-shot: send the body up to this file offset, then drop the connection
    drop_at: int | None = None
    #: one-shot: send the body up to this file offset, then go silent until ``release``
    stall_at: int | None = None
    #: one-shot: go silent before sending anything (not even headers) until ``release``
    stall_headers: bool = False
    #: every GET of this file waits for this event before sending its headers
    gate: threading.Event | None = None
    #: extra response headers (the Hugging Face endpoint stand-in needs some)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class Hit:
    method: str
    path: str
    range: str | None
    status: int
    #: body bytes actually written
    sent: int


class FileServer:
    """``with FileServer() as server: server.files["/m.gguf"] = Served(data)``."""

    def __init__(self) -> None:
        self.files: dict[str, Served] = {}
        #: in the order the requests arrived (a response's log line can race the next one's)
        self.hits: list[Hit] = []
        self._arrivals: list[int] = []
        self._counter = itertools.count()
        self.release = threading.Event()  # frees every stalled response
        self.stalled = threading.Event()  # set when a response goes silent
        self.requested = threading.Event()  # set at every GET (after logging it)
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fileserver"
        )

    def url(self, path: str) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{path}"

    @property
    def gets(self) -> list[Hit]:
        with self._lock:
            return [h for h in self.hits if h.method == "GET"]

    def __enter__(self) -> FileServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release.set()
        for served in self.files.values():
            if served.gate is not None:
                served.gate.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _arrive(self) -> int:
        with self._lock:
            return next(self._counter)

    def _log(self, hit: Hit, arrival: int) -> None:
        with self._lock:
            at = bisect.bisect(self._arrivals, arrival)
            self._arrivals.insert(at, arrival)
            self.hits.insert(at, hit)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return None

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                arrival = server._arrive()
                served = server.files.get(self.path.split("?")[0])
                asked = self.headers.get("Range")
                method = "GET" if body else "HEAD"
                if served is None or served.status != 200:
                    status = 404 if served is None else served.status
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    for k, v in (served.headers if served else {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    server._log(Hit(method, self.path, asked, status, 0), arrival)
                    if body:
                        server.requested.set()
                    return
                if body and served.gate is not None:
                    server.requested.set()
                    served.gate.wait(SAFETY)
                if body and served.stall_headers:
                    served.stall_headers = False
                    server._log(Hit(method, self.path, asked, 0, 0), arrival)
                    server.requested.set()
                    server.stalled.set()
                    server.release.wait(SAFETY)
                    return
                size = len(served.data)
                start = 0
                if asked and served.ranges and asked.startswith("bytes=") and asked.endswith("-"):
                    start = int(asked[len("bytes=") : -1])
                if start >= size and asked and served.ranges:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    server._log(Hit(method, self.path, asked, 416, 0), arrival)
                    return
                status = 206 if start else 200
                self.send_response(status)
                self.send_header("Content-Length", str(size - start))
                self.send_header("Accept-Ranges", "bytes" if served.ranges else "none")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                for k, v in served.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if not body:
                    server._log(Hit(method, self.path, asked, status, 0), arrival)
                    return
                stop, then = size, None
                if served.drop_at is not None and served.drop_at > start:
                    stop, then, served.drop_at = served.drop_at, "drop", None
                elif served.stall_at is not None and served.stall_at > start:
                    stop, then, served.stall_at = served.stall_at, "stall", None
                sent = 0
                try:
                    view = memoryview(served.data)
                    for i in range(start, stop, 16 * 1024):
                        chunk = view[i : min(stop, i + 16 * 1024)]
                        self.wfile.write(chunk)
                        sent += len(chunk)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                server._log(Hit(method, self.path, asked, status, sent), arrival)
                server.requested.set()
                if then == "stall":
                    server.stalled.set()
                    server.release.wait(SAFETY)
                self.close_connection = True

        return Handler
