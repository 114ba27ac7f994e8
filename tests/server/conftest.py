"""A real uvicorn on an ephemeral port, raw socket clients, and a trace recorder.

Every server test talks to a real ``uvicorn.Server`` running in a thread over a
socket bound to ``127.0.0.1:0``: disconnects, TCP flow control and chunked bodies
are the kernel's, not a test transport's. Tests synchronise on trace events
(``Recorder``), never on elapsed time; ``NET`` is a safety net for every wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import ollama
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import plainhttp
from tokenbelt import EndReason, GenerationRequest, Runtime, ScriptedEngine
from tokenbelt.belt import Belt, Trace, TraceEvent
from tokenbelt.models import default_model_path
from tokenbelt.runtime import Model
from tokenbelt.server import ServerSettings, create_app, http_protocol

#: a safety net for every wait, never the assertion itself
NET = 30.0


def eventually(check: Callable[[], bool], what: str = "the condition") -> None:
    """Poll ``check`` until it holds (what the server does after its answer, such as
    storing a response); fails naming ``what`` after ``NET`` seconds."""
    deadline = time.monotonic() + NET
    while not check():
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.01)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


# -- observing requests -----------------------------------------------------------------------


class Recorder:
    """A runtime observer that keeps every trace event and lets tests wait for one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.events: list[TraceEvent] = []

    def __call__(self, event: TraceEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def _until(self, found: Callable[[], Any], what: str, timeout: float) -> Any:
        with self._cond:
            result = self._cond.wait_for(found, timeout)
        if not result:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        return result

    def nth(self, n: int, timeout: float = NET) -> Trace:
        """The trace of the ``n``-th request enqueued on this server (0-based)."""

        def found() -> Trace | None:
            traces = [e.trace for e in self.events if e.kind == "enqueued"]
            return traces[n] if len(traces) > n else None

        trace: Trace = self._until(found, f"request #{n}", timeout)
        return trace

    def by_id(self, request_id: str, timeout: float = NET) -> Trace:
        def found() -> Trace | None:
            for e in self.events:
                if e.kind == "enqueued" and e.trace.request_id == request_id:
                    return e.trace
            return None

        trace: Trace = self._until(found, f"request {request_id}", timeout)
        return trace

    def wait(self, trace: Trace, kind: str, timeout: float = NET) -> TraceEvent:
        """Wait for the event ``kind`` (``admitted``, ``first_token``, ``released``...)."""

        def found() -> TraceEvent | None:
            for e in self.events:
                if e.trace is trace and e.kind == kind:
                    return e
            return None

        event: TraceEvent = self._until(found, f"{kind} of {trace.request_id}", timeout)
        return event

    def enqueued(self) -> list[Trace]:
        """The traces of every request enqueued so far."""
        with self._cond:
            return [e.trace for e in self.events if e.kind == "enqueued"]

    def kinds(self, trace: Trace) -> list[str]:
        with self._cond:
            return [e.kind for e in self.events if e.trace is trace]


# -- the server -------------------------------------------------------------------------------


@dataclass
class Served:
    """A running server: its base URL, its runtime and a recorder of its requests."""

    url: str
    app: FastAPI
    runtime: Runtime
    recorder: Recorder

    @property
    def port(self) -> int:
        return int(urlsplit(self.url).port or 0)

    def model(self, name: str | None = None) -> Model:
        models = self.runtime.models
        return models[name] if name else next(iter(models.values()))

    def assert_released(self, trace: Trace, reason: EndReason) -> None:
        """The request ended with ``reason``, its release is recorded and the engine is idle."""
        self.recorder.wait(trace, "released")
        assert trace.end_reason is reason
        assert trace.released is not None
        kinds = self.recorder.kinds(trace)
        assert kinds.count("released") == 1
        assert kinds.count("ended") == 1
        # The slot is handed back before the release is recorded: idle now, not "soon".
        stats = self.model(trace.model).statistics()
        assert stats.running == 0, stats
        assert stats.queued == 0, stats

    def wait_queued(self, n: int, timeout: float = NET) -> None:
        """Wait (under the safety net) until ``n`` requests wait in the model's queue: a
        request's enqueue mark (what ``recorder.nth`` sees) comes just before the
        scheduler appends it, so the count may lag the mark by a moment."""
        deadline = time.monotonic() + timeout
        while (queued := self.model().statistics().queued) != n:
            assert time.monotonic() < deadline, f"{queued} queued, not {n}, after {timeout} s"
            time.sleep(0.005)


ServeFactory = Callable[..., Served]


class _Server(uvicorn.Server):
    """uvicorn's server, keeping its event loop (the loop of its worker threads too)."""

    loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)


_Running = tuple[_Server, threading.Thread, Runtime, socket.socket]


def _start(
    runtime: Runtime,
    settings: ServerSettings | None = None,
    *,
    sndbuf: int | None = None,
    **kwargs: Any,
) -> tuple[_Running, Served]:
    app = create_app(runtime, settings, **kwargs)
    # Subscribed after the app's own observers: once the recorder has seen an event,
    # the server's metrics, log line and request record have it too.
    recorder = Recorder()
    runtime.subscribe(recorder)
    # IPPROTO_TCP spelled out: asyncio turns Nagle off (TCP_NODELAY) only on sockets
    # whose proto says TCP, as uvicorn's own sockets do; with proto 0, every
    # response on a kept-alive connection would wait out a delayed ACK (40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=http_protocol((settings or ServerSettings()).read_timeout),
    )
    server = _Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True
    )
    thread.start()
    running = (server, thread, runtime, sock)
    deadline = time.monotonic() + NET
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            _stop(running)
            raise AssertionError("uvicorn did not start")
        thread.join(0.01)
    port = sock.getsockname()[1]
    return running, Served(f"http://127.0.0.1:{port}", app, runtime, recorder)


def _stop(running: _Running) -> None:
    server, thread, runtime, sock = running
    server.should_exit = True
    thread.join(NET)
    runtime.close()
    sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture
def serve() -> Iterator[ServeFactory]:
    """``serve(runtime, settings=None, sndbuf=None, **create_app_kwargs)`` starts uvicorn.

    It binds ``127.0.0.1:0``, waits for ``server.started`` and returns a ``Served``.
    ``sndbuf`` fixes the kernel send buffer of every accepted connection (they inherit
    it from the listening socket), as on a machine with small socket buffers.
    Teardown asks each server to exit, joins its thread and closes its runtime.
    """
    running: list[_Running] = []

    def start(runtime: Runtime, settings: ServerSettings | None = None, **kwargs: Any) -> Served:
        handle, served = _start(runtime, settings, **kwargs)
        running.append(handle)
        return served

    yield start
    for handle in reversed(running):
        _stop(handle)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "own_server: the test needs a server of its own, not its module's shared one"
    )


class SharedServer:
    """One real server shared by the tests of a module that need no server of their own.

    Starting a server with the real model loaded costs seconds; a test that only sends
    requests and reads their replies and traces does not need a fresh one. Each test
    gets its own view (``view``): a fresh recorder that sees only that test's requests,
    so ``recorder.nth(0)`` and ``recorder.events == []`` mean what they say, and at its
    end every request it sent must have been released, so none runs into the next test.
    Tests that assert fresh state (restarts, loads and unloads, crashes, shutdown, the
    request list, metrics totals) are marked ``own_server`` and get a server of their own.
    """

    def __init__(
        self,
        make_runtime: Callable[[], Runtime],
        settings: ServerSettings | None = None,
        **kwargs: Any,
    ) -> None:
        self._make_runtime = make_runtime
        self._settings = settings
        self._kwargs = kwargs
        self._running, self._served = _start(make_runtime(), settings, **kwargs)
        # The worker threads its event loop starts on demand live as long as the server,
        # not as long as the test that happened to start them (see ``no_leaked_threads``).
        loop = self._running[0].loop
        assert loop is not None
        loop.shared_by_module = True  # type: ignore[attr-defined]
        self._current = Recorder()
        self._served.runtime.subscribe(lambda event: self._current(event))

    def view(self, request: pytest.FixtureRequest) -> Iterator[Served]:
        """This test's server: a view of the shared one, or (``own_server``) its own."""
        if request.node.get_closest_marker("own_server") is not None:
            serve: ServeFactory = request.getfixturevalue("serve")
            yield serve(self._make_runtime(), self._settings, **self._kwargs)
            return
        recorder = self._current = Recorder()
        served = self._served
        yield Served(served.url, served.app, served.runtime, recorder)
        for trace in recorder.enqueued():
            recorder.wait(trace, "released")
        self._current = Recorder()

    def close(self) -> None:
        _stop(self._running)


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty tokenbelt home for a module's shared server (as ``tokenbelt_home`` per test)."""
    with pytest.MonkeyPatch.context() as patch:
        home = tmp_path_factory.mktemp("tokenbelt-home")
        patch.setenv("TOKENBELT_HOME", str(home))
        yield home


@pytest.fixture
def served(shared: SharedServer, request: pytest.FixtureRequest) -> Iterator[Served]:
    """This test's view of its module's server: the module's ``shared`` fixture (a
    ``shared_server``). A module that starts a server per test defines its own."""
    yield from shared.view(request)


@contextlib.contextmanager
def shared_server(
    make_runtime: Callable[[], Runtime], settings: ServerSettings | None = None, **kwargs: Any
) -> Iterator[SharedServer]:
    """A ``SharedServer`` serving ``make_runtime()``, stopped when the block ends."""
    shared = SharedServer(make_runtime, settings, **kwargs)
    try:
        yield shared
    finally:
        shared.close()


# -- runtimes ---------------------------------------------------------------------------------


def scripted_runtime(
    *engines: ScriptedEngine | Any, name: str = "scripted", slots: int = 1, queue_size: int = 4
) -> Runtime:
    """A runtime with one scripted model of ``len(engines)`` slots."""
    runtime = Runtime(keep_alive=None, slots=slots, queue_size=queue_size)
    runtime.add_engines(name, list(engines))
    return runtime


def words(n: int, size: int = 0) -> list[str]:
    """``n`` pieces; with ``size``, each piece is that many bytes (to fill socket buffers)."""
    if size:
        return [(f"{i:08d}" + "x" * size)[:size] for i in range(n)]
    return [f" w{i}" for i in range(n)]


def real_runtime(**options: Any) -> Runtime:
    """A runtime with the real embedded default model loaded (about 0.5 s)."""
    runtime = Runtime(keep_alive=None, **options)
    runtime.load(str(default_model_path()))
    return runtime


#: about 2,000 prompt tokens on the default model: a prefill of several seconds here
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 200)


class StallingEngine(ScriptedEngine):
    """Sends ``tokens`` and then produces nothing more until it is cancelled.

    The wait watches the belt, as a decode step with an abort hook would: a stall
    deadline ends it at once.
    """

    def generate(self, request: GenerationRequest, belt: Belt[str]) -> EndReason:
        woken = threading.Event()
        belt.on_cancel(lambda _reason: woken.set())
        belt.trace.prompt_tokens = self.count_prompt_tokens(request)
        for token in self.tokens:
            belt.wait_for_room()
            belt.trace.completion_tokens += 1
            belt.put(token)
        while not woken.wait(NET):
            pass
        belt.checkpoint()
        return EndReason.STOP


# -- a raw HTTP/1.1 client ----------------------------------------------------------------------


class RawClient:
    """One HTTP/1.1 request over a plain socket that the test may close at any moment.

    ``rcvbuf`` shrinks the socket's receive buffer (set before connecting, so the
    advertised TCP window is small too): a reader that reads nothing fills it fast.
    """

    def __init__(self, url: str, *, rcvbuf: int | None = None) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(NET)
        self.sock.connect((self.host, parts.port or 80))
        self.buffer = bytearray()
        self.status: int | None = None
        self.headers: dict[str, str] = {}

    def send(
        self,
        path: str,
        body: dict[str, Any] | bytes,
        *,
        method: str = "POST",
        headers: dict[str, str] | None = None,
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        lines = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self.host}",
            "Content-Type: application/json",
            f"Content-Length: {len(data)}",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)

    def fill(self, size: int = 65536) -> bool:
        """Receive once into ``buffer``; False when the server closed the connection."""
        chunk = self.sock.recv(size)
        self.buffer += chunk
        return bool(chunk)

    def read_head(self) -> tuple[int, dict[str, str]]:
        """Read the status line and headers (the body stays buffered)."""
        while b"\r\n\r\n" not in self.buffer:
            if not self.fill():
                raise AssertionError(f"connection closed before the head: {self.buffer!r}")
        head, rest = bytes(self.buffer).split(b"\r\n\r\n", 1)
        self.buffer = bytearray(rest)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {
            k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)
        }
        return self.status, self.headers

    def read_until(self, marker: bytes) -> bytes:
        """Read until ``marker`` is in what was received; returns all of it."""
        start = 0
        while self.buffer.find(marker, start) < 0:
            start = max(0, len(self.buffer) - len(marker))
            if not self.fill():
                raise AssertionError(f"connection closed before {marker!r}")
        return bytes(self.buffer)

    def read_to_close(self) -> bytes:
        while self.fill():
            pass
        return bytes(self.buffer)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sse_events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body (chunked framing is skipped line by line)."""
    events: list[Any] = []
    for line in raw.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def collect(lines: Sequence[str] | Iterator[str]) -> list[Any]:
    """The events of an SSE stream read line by line with httpx."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_in_prefill(served: Served, trace: Trace, timeout: float = NET) -> None:
    """Wait until the batch engine has evaluated a first chunk of ``trace``'s prompt.

    The engine's own step counter is the condition (the prompt goes in 512-token steps,
    so a prompt of 2,000 tokens is still being evaluated then), not elapsed time.
    """
    engine = served.model(trace.model).engines[0]
    stepped = engine.statistics().tokens_stepped  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while engine.statistics().tokens_stepped - stepped < 512:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"{trace.request_id}: no prefill step in {timeout} s"
        time.sleep(0.002)


# -- clients and metrics, shared by the dialects' tests -------------------------------------


@contextlib.contextmanager
def connect_ollama(url: str, timeout: float | httpx.Timeout = NET) -> Iterator[ollama.Client]:
    """An ``ollama.Client`` whose connections close at the end of the block.

    The test owns the transport: clients before 0.6 are no context managers.
    """
    transport = httpx.HTTPTransport()
    try:
        yield ollama.Client(host=url, timeout=timeout, transport=transport)
    finally:
        transport.close()


def scrape(served: Served) -> dict[str, list[Sample]]:
    """The server's ``/metrics``: every sample, by series name."""
    response = plainhttp.get(f"{served.url}/metrics", timeout=NET)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` with ``labels`` (more or none fail)."""
    found = [
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]
