"""What the HTTP service keeps between requests: models, load status, live and recent requests."""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..._errors import (
    InvalidArgument,
    ModelLoadError,
    ModelLoading,
    OverBudget,
    TokenbeltError,
    UnknownModel,
)
from ...belt import Limits, Trace, TraceEvent
from ...engines import HEARTBEAT_BOUND_S, EngineStatistics, WorkerStatistics
from ...runtime import Model, ModelState, ModelStatus, Runtime, Stream
from ._metrics import Metrics
from ._middleware import Caller
from ._options import TokenbeltOptions

logger = logging.getLogger("tokenbelt.server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


@dataclass(frozen=True)
class ServerSettings:
    """How the HTTP service runs; every field has a safe default.

    Where requests are bounded (capacity, slots, queue, deadlines) is the runtime's to
    say; a field here that repeats one of those is an override, unset by default.
    """

    #: belt capacity and time limits of every HTTP request that names none of its own;
    #: None (the default): the runtime's own (``Runtime(capacity=..., limits=...)``)
    capacity: int | None = None
    first_token_timeout: float | None = None
    total_timeout: float | None = None
    stall_timeout: float | None = None
    #: a thinking model's reasoning budget (tokens) and deadline (seconds) for every
    #: request that names none (``tokenbelt.reasoning_budget``, a dialect's own field)
    reasoning_budget: int | None = None
    reasoning_timeout: float | None = None
    api_key: str | None = None
    #: more client keys, each its own caller: a request is read and cancelled only with
    #: the key that made it (or the admin key)
    api_keys: tuple[str, ...] = ()
    #: sees and cancels every request (``GET /v1/requests`` lists them all)
    admin_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    #: the largest audio upload (``/v1/audio/``: OpenAI's own limit), and its longest audio
    max_audio_bytes: int = 25 << 20
    max_audio_seconds: float = 30 * 60.0
    recent_requests: int = 200
    retry_after_s: int = 1
    #: bytes of ``/v1/responses`` objects kept for ``previous_response_id`` and ``GET``
    #: (0, the default: none; the server is stateless and says so)
    responses_store_bytes: int = 0
    #: seconds a stored response is kept after it was last used
    responses_ttl_s: float = 3600.0
    #: what ``/v1/responses`` does with a built-in tool (``web_search``...), which a local
    #: server cannot run: ``skip`` leaves it out, named in the response's
    #: ``tokenbelt.skipped_tools`` and in the log (a client such as Codex always sends
    #: its own); ``refuse`` answers 400 naming it
    responses_builtin_tools: Literal["skip", "refuse"] = "skip"
    #: with ``refuse``, the built-in tool types still left out
    responses_skip_tools: tuple[str, ...] = ()
    #: seconds a stream may send nothing (a long prefill, a queue) before it writes a
    #: keepalive (an SSE comment; Anthropic's ``ping``); None: never
    keepalive_s: float | None = 15.0
    #: seconds a stream's socket may accept nothing before it ends ``reader_timeout``
    reader_timeout: float | None = 30.0
    #: seconds for a request's head and body to arrive before the connection is closed
    read_timeout: float | None = 30.0
    #: Host header values served (any port); anything else is refused (DNS rebinding)
    allowed_hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "[::1]")

    def __post_init__(self) -> None:
        for key in self.keys():
            if not key.strip():
                raise InvalidArgument("an API key is blank: give a key, or none")
            if key != key.strip():
                raise InvalidArgument("an API key starts or ends with white space")
        if self.responses_store_bytes < 0:
            raise InvalidArgument("responses_store_bytes must be >= 0 (0: no store)")
        if not self.responses_ttl_s > 0:
            raise InvalidArgument("responses_ttl_s must be > 0 seconds")
        if self.responses_builtin_tools not in ("skip", "refuse"):
            raise InvalidArgument(
                "responses_builtin_tools must be 'skip' or 'refuse', "
                f"got {self.responses_builtin_tools!r}"
            )
        for name in ("reader_timeout", "read_timeout", "keepalive_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidArgument(f"{name} must be > 0 seconds (None: no limit)")

    def keys(self) -> tuple[str, ...]:
        """Every key the API accepts: the client keys, then the admin key."""
        keys: tuple[str, ...] = (self.api_key,) if self.api_key is not None else ()
        keys += self.api_keys
        return keys + ((self.admin_key,) if self.admin_key is not None else ())


@dataclass
class LoadStatus:
    """Where loading one model stands, for 503 answers and the web page."""

    alias: str
    state: str = "loading"  # loading | ready | failed
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    #: bytes of the model file on disk so far, and in all, while it downloads
    received: int | None = None
    total: int | None = None

    def progress(self, received: int, total: int | None) -> None:
        """A download progress callback (called on the loading thread)."""
        self.received, self.total = received, total

    def to_dict(self) -> dict[str, Any]:
        end = self.finished if self.finished is not None else time.monotonic()
        return {
            "state": self.state,
            "error": self.error,
            "elapsed_s": round(end - self.started, 3),
            "download": None
            if self.received is None
            else {"received_bytes": self.received, "total_bytes": self.total},
        }


class ServerState:
    """Shared by every request of one app; thread-safe."""

    def __init__(self, runtime: Runtime, settings: ServerSettings) -> None:
        self.runtime = runtime
        self.settings = settings
        self.loads: dict[str, LoadStatus] = {}
        #: called with each model a background load made ready (``tokenbelt serve`` prints it)
        self.on_ready: Callable[[Model], None] | None = None
        #: set once a shutdown began: new requests are answered 503
        self.shutting_down = False
        self._lock = threading.Lock()
        self._active: dict[str, Stream] = {}
        self._recent: collections.OrderedDict[str, Trace] = collections.OrderedDict()
        #: request id -> the caller (key identity) that made it, for requests made with a key
        self._owners: dict[str, str] = {}
        self.metrics = Metrics(
            lambda: {name: m.statistics() for name, m in runtime.models.items()},
            self._engine_statistics,
            self.model_statuses,
            lambda: runtime.budget.limit,
        )
        runtime.subscribe(self.metrics.observe)
        runtime.subscribe(self._remember)

    def _engine_statistics(self) -> list[tuple[str, EngineStatistics]]:
        """Every engine's snapshot, by the name of its model."""
        return [
            (name, e.statistics()) for name, m in self.runtime.models.items() for e in m.engines
        ]

    def workers(self) -> dict[str, WorkerStatistics]:
        """The worker process of every model that runs in one (``isolation="process"``)."""
        return {name: s.worker for name, s in self._engine_statistics() if s.worker is not None}

    # -- models ------------------------------------------------------------------------------

    def load_in_background(self, alias: str, **options: Any) -> threading.Thread:
        """Start loading ``alias``; requests for it get 503 until it is ready."""
        name = self.runtime.name_for(alias)
        status = LoadStatus(name)
        self.loads[name] = status

        def run() -> None:
            try:
                model = self.runtime.load(alias, progress=status.progress, **options)
            except TokenbeltError as exc:
                status.state, status.error = "failed", str(exc)
                logger.error("loading %s failed: %s", alias, exc)
            except Exception as exc:  # a native or unexpected failure: report, don't crash
                status.state, status.error = "failed", f"{type(exc).__name__}: {exc}"
                logger.exception("loading %s failed", alias)
            else:
                status.state = "ready"
                logger.info("model %s is ready", alias)
                if self.on_ready is not None:
                    self.on_ready(model)
            finally:
                status.finished = time.monotonic()

        thread = threading.Thread(target=run, name=f"tokenbelt-load-{alias}", daemon=True)
        thread.start()
        return thread

    def catalog(self) -> list[dict[str, Any]]:
        """The catalog's aliases this server could be started with, and if they are cached."""
        from ...models import Catalog, Home, ModelCache

        try:
            home = Home.from_env()
            catalog, cache = Catalog.load(home), ModelCache(home)
            return [
                {
                    "alias": entry.alias,
                    "cached": any(cache.is_cached(v) for v in entry.variants),
                    "context_length": entry.context_length,
                }
                for entry in catalog
            ]
        except (TokenbeltError, OSError) as exc:
            logger.warning("cannot read the model catalog: %s", exc)
            return []

    def readiness(self) -> tuple[str, str | None]:
        """(status, why not ready): ``ok`` only when every served model can take a
        request now or on demand (an idle-unloaded model reloads for the next one)."""
        if self.shutting_down:
            return "shutting_down", "the server is shutting down"
        failed = [s for s in self.loads.values() if s.state == "failed"]
        if failed:
            return "failed", "; ".join(f"model {s.alias} failed to load: {s.error}" for s in failed)
        loading = [s.alias for s in self.loads.values() if s.state == "loading"]
        if loading:
            return "loading", f"model {', '.join(loading)} is loading"
        models = self.runtime.models
        if not models:
            return "no_model", "no model is served"
        never = [
            (n, m.load_error)
            for n, m in models.items()
            if isinstance(m.load_error, OverBudget) and not m.load_error.transient
        ]
        if never:  # refused by the budget until the server is started otherwise
            return "failed", "; ".join(f"model {n}: {why}" for n, why in never)
        # READY, IDLE_UNLOADED and a reload in progress (LOADING) all take requests.
        closed = [n for n, m in models.items() if m.state is ModelState.CLOSED]
        if closed:
            return "failed", f"model {', '.join(closed)} is closed"
        workers = self.workers()
        dead = [(n, w.failure) for n, w in workers.items() if w.failure]
        if dead:  # its worker kept dying while it loaded: no request can be served
            return "failed", "; ".join(f"model {n}: {why}" for n, why in dead)
        frozen = [(n, w) for n, w in workers.items() if w.unresponsive_s is not None]
        if frozen:  # alive, but its loop answers no heartbeat: frozen, or stuck in a step
            return "unresponsive", "; ".join(
                f"model {n}: its engine worker {w.pid} has answered no heartbeat for "
                f"{w.unresponsive_s:.1f} s (the bound is {HEARTBEAT_BOUND_S:.0f} s)"
                for n, w in frozen
            )
        return "ok", None

    def model_names(self) -> list[str]:
        names = list(self.runtime.models)
        names += [a for a in self.loads if a not in names]
        return names

    def model_for(self, name: str | None) -> Model:
        """The model a request names (or the default); raises 404/503-mapped errors.

        Models are named as this server lists them. A path is never looked up on disk:
        whether a file exists is nothing a client may learn from the answer.
        """
        models = self.runtime.models
        if name is None or name == "":
            loading = [s for s in self.loads.values() if s.state == "loading"]
            if loading:  # the model the server was started with: answered 503 meanwhile
                raise ModelLoading(f"model {loading[0].alias} is still loading")
            if models:
                return next(iter(models.values()))
            failed = [s for s in self.loads.values() if s.state == "failed"]
            if failed:
                raise ModelLoadError(f"model {failed[0].alias} failed to load: {failed[0].error}")
            raise UnknownModel("no model is loaded on this server")
        status = self.loads.get(name)
        if status is not None and status.state == "loading":
            raise ModelLoading(f"model {name} is still loading")
        if name in models:
            return models[name]
        if status is not None and status.state == "failed":
            raise ModelLoadError(f"model {name} failed to load: {status.error}")
        available = ", ".join(self.model_names()) or "none"
        if any(entry["alias"] == name for entry in self.catalog()):
            raise UnknownModel(
                f"model {name!r} is in this machine's catalog but this server does not serve "
                f"it (start the server with it: tokenbelt serve ... {name}); available: "
                f"{available}"
            )
        raise UnknownModel(f"unknown model {name!r}; available: {available}")

    def model_statuses(self) -> list[ModelStatus]:
        """Where each served model stands (loaded or not and why, memory, slots)."""
        return [m.status() for m in self.runtime.models.values()]

    def memory(self, statuses: list[ModelStatus]) -> dict[str, Any]:
        """The memory budget and what the models of ``statuses`` take of it, in bytes (the
        same snapshot ``/health`` shows: each worker's memory is read once)."""
        return {
            "budget_bytes": self.runtime.budget.limit,
            "used_bytes": sum(s.memory.total for s in statuses if s.memory is not None),
            "evictions": len(self.runtime.budget.evictions),
        }

    def limits_for(self, options: TokenbeltOptions | None, model: Model) -> Limits:
        """A request's time limits: its own, else the server's override, else the model's
        (the runtime's own)."""
        settings, base = self.settings, model.limits
        first_token = options.first_token_timeout if options else None
        total = options.total_timeout if options else None
        stall = options.stall_timeout if options else None
        return Limits(
            first_token=first_token or settings.first_token_timeout or base.first_token,
            total=total or settings.total_timeout or base.total,
            stall=stall or settings.stall_timeout or base.stall,
        )

    def capacity_for(self, options: TokenbeltOptions | None) -> int | None:
        """A request's belt capacity: its own, else the server's override; None: the model's."""
        return (options.capacity if options else None) or self.settings.capacity

    # -- requests ----------------------------------------------------------------------------

    def request_id_from(self, given: str | None) -> str | None:
        """A caller's request id if it is well-formed and new here, else None (a new one)."""
        if given is None or not _REQUEST_ID.match(given):
            return None
        with self._lock:
            if given in self._active or given in self._recent:
                return None
        return given

    def own(self, request_id: str, caller: Caller | None) -> None:
        """Record that ``caller`` makes ``request_id`` (before it is submitted)."""
        if caller is not None:
            with self._lock:
                self._owners[request_id] = caller.identity

    def disown(self, request_id: str) -> None:
        """Forget the owner of a request that was refused before it got a trace."""
        with self._lock:
            if request_id not in self._recent:
                self._owners.pop(request_id, None)

    def track(self, stream: Stream) -> None:
        with self._lock:
            if stream.trace.released is None:
                self._active[stream.request_id] = stream

    def visible_to(self, request_id: str, caller: Caller | None) -> bool:
        """Whether ``caller`` may read or cancel ``request_id`` (None: the API has no keys)."""
        if caller is None or caller.admin:
            return True
        with self._lock:
            return self._owners.get(request_id) == caller.identity

    def _remember(self, event: TraceEvent) -> None:
        trace = event.trace
        with self._lock:
            if event.kind == "enqueued":
                self._recent[trace.request_id] = trace
                while len(self._recent) > self.settings.recent_requests:
                    gone, _ = self._recent.popitem(last=False)
                    self._owners.pop(gone, None)
            elif event.kind == "released":
                self._active.pop(trace.request_id, None)

    def active(self, request_id: str, caller: Caller | None = None) -> Stream | None:
        if not self.visible_to(request_id, caller):
            return None
        with self._lock:
            return self._active.get(request_id)

    def trace(self, request_id: str, caller: Caller | None = None) -> Trace | None:
        if not self.visible_to(request_id, caller):
            return None
        with self._lock:
            return self._recent.get(request_id)

    def recent(self, limit: int, caller: Caller | None = None) -> list[Trace]:
        with self._lock:
            traces = list(self._recent.values())
        traces = [t for t in traces if self.visible_to(t.request_id, caller)]
        return traces[-limit:][::-1]
