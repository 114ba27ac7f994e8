"""Fronts and upstreams for the remote engine's tests, all on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import plainhttp
from server.conftest import NET, Served, ServeFactory, scripted_runtime
from tokenbelt import Runtime, ScriptedEngine, Upstream


def upstream(serve: ServeFactory, *engines: ScriptedEngine, slots: int = 1) -> Served:
    """A tokenbelt server of scripted engines (model ``scripted``)."""
    return serve(scripted_runtime(*engines, slots=slots, queue_size=8))


def front(
    serve: ServeFactory,
    *upstreams: Served | str,
    model: str = "scripted",
    max_concurrency: int = 2,
    **options: Any,
) -> Served:
    """A tokenbelt server whose model ``model`` is served by ``upstreams``."""
    runtime = Runtime(keep_alive=None, queue_size=8)
    # Known to be tokenbelt servers, as ``add_upstreams`` finds out from their model lists.
    ups = [
        Upstream(
            u if isinstance(u, str) else u.url,
            model,
            max_concurrency=max_concurrency,
            tokenbelt=not isinstance(u, str),
        )
        for u in upstreams
    ]
    options.setdefault("health_interval", 0.2)
    runtime.add_remote(model, ups, **options)
    return serve(runtime)


def upstream_trace(served: Served, request_id: str) -> dict[str, Any]:
    """The upstream's own record of a request (its trace API)."""
    answer = plainhttp.get(f"{served.url}/v1/requests/{request_id}", timeout=NET)
    assert answer.status_code == 200, answer.text
    trace: dict[str, Any] = answer.json()
    return trace


class SilentServer:
    """Accepts connections and never answers; records when each one is closed."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = threading.Event()
        self.closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, name="test-silent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.sock.accept()
            self._conns.append(conn)
            self.accepted.set()
            conn.settimeout(NET)
            while conn.recv(65536):  # the request, then nothing until the peer closes
                pass
            self.closed.set()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self._conns:
            conn.close()
        self._thread.join(NET)


@contextlib.contextmanager
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    try:
        yield server
    finally:
        server.close()
