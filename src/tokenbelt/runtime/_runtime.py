"""The runtime: the application's handle on every loaded model."""

from __future__ import annotations

import difflib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._defaults import DEFAULT_CAPACITY, DEFAULT_QUEUE_SIZE, DEFAULT_SLOTS
from .._errors import InvalidArgument, RuntimeClosed, UnknownModel, UpstreamUnavailable
from ..belt import DeadlineTimer, Limits, Observer, check_capacity, check_duration
from ..engines import (
    DEFAULT_STOP_GRACE,
    BatchEngine,
    Engine,
    RemoteEngine,
    Upstream,
    UpstreamModel,
    UpstreamPool,
    WorkerEngine,
    check_threads,
    default_threads,
    list_models,
)
from ..models import DEFAULT_ALIAS, NAME_PATTERN, find_remote, resolve_and_fetch
from ._model import Model

logger = logging.getLogger("tokenbelt.runtime")

#: where a loaded model runs: in this process, or in a worker process of its own
ISOLATIONS = ("thread", "process")

#: the smallest context a sequence may have: a chat template, a short turn and a reply
MIN_N_CTX = 64


def check_n_ctx(value: int) -> int:
    """Reject an ``n_ctx`` too small to hold a prompt (the SDK's and the CLI's check)."""
    check_capacity(value, name="n_ctx")
    if value < MIN_N_CTX:
        raise InvalidArgument(
            f"n_ctx must be at least {MIN_N_CTX} tokens (a chat template and a short turn), "
            f"got {value}"
        )
    return value


class Runtime:
    """Catalog, cache and loaded models; a context manager (sync and async).

    Defaults given here apply to every model it loads: ``slots`` (sequences
    batched in one context; each may hold ``n_ctx`` tokens), ``queue_size`` (the
    bounded admission queue),
    ``capacity`` (belt length: how far generation may run ahead of a reader),
    ``limits`` (deadlines) and ``keep_alive`` (seconds idle before a model is
    unloaded; ``None`` keeps it). ``n_threads`` and ``n_threads_batch`` are
    llama.cpp's decode and prompt thread counts (``None``: every core this process
    may use, for both). ``prefill_chunk`` is the most prompt tokens one batched step
    takes while other sequences decode (smaller: smoother running streams, slower
    first token for a long new prompt). ``n_ctx`` is at least ``MIN_N_CTX`` (room for
    a chat template and a short turn) and at most what the model was trained on, unless
    ``force_n_ctx``. ``prefix_cache=False`` computes every prompt in
    full instead of reusing the KV cells of an earlier or running one with the same
    start, so a prompt's arithmetic depends only on its batch, not on what ran before.
    ``isolation`` says where a loaded model runs: ``"thread"`` (in this process, the
    cheapest path) or ``"process"`` (a worker process per model: a native crash ends
    that model's running requests with ``runtime_error`` instead of this process, the
    worker restarts, and a stop not honoured within ``stop_grace`` seconds kills it).
    ``close()`` cancels everything with ``shutdown``, waits for every release, then
    unloads.
    """

    def __init__(
        self,
        *,
        slots: int = DEFAULT_SLOTS,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        capacity: int = DEFAULT_CAPACITY,
        limits: Limits | None = None,
        keep_alive: float | None = 300.0,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        prefill_chunk: int = 128,
        prefix_cache: bool = True,
        isolation: str = "thread",
        stop_grace: float = DEFAULT_STOP_GRACE,
        force_n_ctx: bool = False,
        observers: Sequence[Observer] = (),
    ) -> None:
        if isolation not in ISOLATIONS:
            raise InvalidArgument(
                f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}"
            )
        self.slots = check_capacity(slots, name="slots")
        self.queue_size = check_capacity(queue_size, name="queue_size")
        self.capacity = check_capacity(capacity)
        self.limits = limits or Limits()
        self.keep_alive = keep_alive
        self.n_ctx = check_n_ctx(n_ctx)
        #: load with an ``n_ctx`` past what the model was trained on
        self.force_n_ctx = force_n_ctx
        self.n_threads = check_threads("n_threads", n_threads)
        self.n_threads_batch = check_threads("n_threads_batch", n_threads_batch)
        self._observers: list[Observer] = list(observers)
        self.prefill_chunk = check_capacity(prefill_chunk, name="prefill_chunk")
        self.prefix_cache = prefix_cache
        self.isolation = isolation
        grace = check_duration("stop_grace", stop_grace, allow_zero=False)
        if grace is None:
            raise InvalidArgument("stop_grace must be a number of seconds, got None")
        self.stop_grace = grace
        self._models: dict[str, Model] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._timer = DeadlineTimer()

    # -- observers ---------------------------------------------------------------------------

    def subscribe(self, observer: Observer) -> None:
        """Call ``observer`` for every lifecycle event of every later request."""
        self._observers.append(observer)

    # -- models ------------------------------------------------------------------------------

    @property
    def models(self) -> dict[str, Model]:
        with self._lock:
            return dict(self._models)

    def get(self, name: str) -> Model:
        """The loaded model called ``name``; ``UnknownModel`` lists the loaded ones."""
        with self._lock:
            model = self._models.get(name)
            names = sorted(self._models)
        if model is None:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UnknownModel(
                f"no loaded model called {name!r} (loaded: {', '.join(names) or 'none'}){hint}"
            )
        return model

    def _register(self, name: str, make: Callable[[], Model]) -> Model:
        with self._lock:
            if self._closed:
                raise RuntimeClosed("the runtime is closed")
            existing = self._models.get(name)
        if existing is not None:
            return existing
        model = make()
        with self._lock:
            if self._closed:
                model.close()
                raise RuntimeClosed("the runtime is closed")
            self._models[name] = model
        return model

    def add_engines(
        self,
        name: str,
        engines: Callable[[], Sequence[Engine]] | Sequence[Engine],
        *,
        info: dict[str, Any] | None = None,
        **options: Any,
    ) -> Model:
        """Register engines (a scripted engine, a custom one) as a model.

        ``engines`` is a callable that makes them, or the engines themselves. Engines
        given ready-made cannot be made again once closed, so that model is never
        unloaded for being idle (no keep-alive); it stays loaded until ``unload()`` or
        ``close()``.
        """
        factory: Callable[[], Sequence[Engine]]
        if callable(engines):
            factory = engines
        else:
            factory = list(engines).copy
            options["keep_alive"] = None
            options["reloadable"] = False
        return self._register(name, lambda: self._model(name, factory, info=info, **options))

    def add_remote(
        self,
        name: str,
        upstreams: Sequence[Upstream],
        *,
        context_length: int = 0,
        health_interval: float | None = 5.0,
        backoff: float = 1.0,
        info: dict[str, Any] | None = None,
        **options: Any,
    ) -> Model:
        """Register a model served by OpenAI-compatible ``upstreams`` (vLLM, llama.cpp's
        server, Ollama, another tokenbelt), routed by least outstanding requests.

        The model's slots are the sum of the upstreams' ``max_concurrency``; beyond
        them requests wait in the model's bounded admission queue. Stops, deadlines
        and backpressure work as for a local model (see ``RemoteEngine``).
        """
        ups = list(upstreams)

        def factory() -> list[Engine]:
            pool = UpstreamPool(ups, backoff=backoff)
            return [
                RemoteEngine(
                    pool, name=name, context_length=context_length, health_interval=health_interval
                )
            ]

        details = {"remote": True, "upstreams": [u.url for u in ups], **(info or {})}
        options.setdefault("keep_alive", None)  # nothing to free here while idle
        return self._register(name, lambda: self._model(name, factory, info=details, **options))

    def add_upstreams(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        max_concurrency: int = 4,
        **options: Any,
    ) -> list[Model]:
        """Serve every model that the servers at ``urls`` list, under their own names.

        Blocking: asks each ``/v1/models`` once. A model listed by several upstreams is
        routed between them. An upstream that does not answer now is logged and added
        to every model (its health check takes it in once it answers); if none
        answers, ``UpstreamUnavailable`` says why.
        """
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        found: dict[str, list[UpstreamModel]] = {}
        down: list[str] = []
        errors: list[str] = []
        for url in urls:
            try:
                listed = list_models(url, headers=headers)
            except UpstreamUnavailable as exc:
                down.append(url)
                errors.append(str(exc))
                continue
            for m in listed:
                found.setdefault(m.name, []).append(m)
        if not found:
            raise UpstreamUnavailable(
                "no upstream listed a model: " + ("; ".join(errors) or "their lists are empty")
            )
        for error in errors:
            logger.warning("%s; it starts ejected", error)
        models = []
        for name, listed in found.items():
            ups = [
                Upstream(
                    m.url,
                    name,
                    api_key=api_key,
                    max_concurrency=max_concurrency,
                    tokenbelt=m.tokenbelt,
                )
                for m in listed
            ]
            ups += [
                Upstream(u, name, api_key=api_key, max_concurrency=max_concurrency)
                for u in down
            ]  # fmt: skip
            context = max(m.context_length for m in listed)
            models.append(self.add_remote(name, ups, context_length=context, **options))
        return models

    def _model(self, name: str, factory: Callable[[], Sequence[Engine]], **options: Any) -> Model:
        params: dict[str, Any] = {
            "queue_size": self.queue_size,
            "capacity": self.capacity,
            "limits": self.limits,
            "keep_alive": self.keep_alive,
            "observers": self._observers,
            "timer": self._timer,
        }
        # None means "the runtime's default", except for keep_alive where it means "never".
        params.update(
            {k: v for k, v in options.items() if v is not None or k in ("info", "keep_alive")}
        )
        return Model(name, factory, **params)

    def load(
        self,
        alias: str = DEFAULT_ALIAS,
        *,
        device: str | None = None,
        slots: int | None = None,
        load_timeout: float | None = None,
        progress: Callable[[int, int | None], None] | None = None,
        **options: Any,
    ) -> Model:
        """Resolve ``alias`` to a variant for this machine, fetch and verify it, load it.

        Blocks while downloading and loading. ``load_timeout`` (or
        ``limits.load``) bounds the load: ``LoadTimeout`` when it passes. An unknown
        alias raises ``UnknownModel`` listing close matches; there is no fallback
        to another model. A path to a ``.gguf`` file loads that file. Loading an
        alias that is already loaded returns the loaded model. A remote entry of the
        user catalog (``tokenbelt models add-remote``) is served by its upstreams
        (``add_remote``).
        """
        remote = find_remote(alias) if NAME_PATTERN.match(alias) else None
        if remote is not None:
            # A model served elsewhere: nothing to download or load here.
            return self.add_remote(alias, remote.upstreams(), **options)
        n_slots = check_capacity(slots, name="slots") if slots is not None else self.slots
        timeout = load_timeout if load_timeout is not None else self.limits.load
        name = self.name_for(alias)
        path, info = self._resolve(alias, device, progress)

        threads, threads_batch = default_threads()
        info.update(
            slots=n_slots,
            n_ctx_per_seq=self.n_ctx,
            threads=self.n_threads or threads,
            threads_batch=self.n_threads_batch or threads_batch,
            prefill_chunk=self.prefill_chunk,
        )

        info["isolation"] = self.isolation
        options_of_engine: dict[str, Any] = {
            "slots": n_slots,
            "n_ctx": self.n_ctx,
            "n_threads": self.n_threads,
            "n_threads_batch": self.n_threads_batch,
            "n_gpu_layers": info.get("n_gpu_layers", 0),
            "prefill_chunk": self.prefill_chunk,
            "cache_entries": 8 if self.prefix_cache else 0,
            "name": name,
            "force_n_ctx": self.force_n_ctx,
        }

        def factory() -> list[Engine]:
            if self.isolation == "process":
                return [
                    WorkerEngine.load(
                        path,
                        load_timeout=timeout,
                        stop_grace=self.stop_grace,
                        **options_of_engine,
                    )
                ]
            return [BatchEngine.load(path, load_timeout=timeout, **options_of_engine)]

        return self._register(name, lambda: self._model(name, factory, info=info, **options))

    @staticmethod
    def name_for(alias: str) -> str:
        """The name ``load(alias)`` registers the model under.

        A path to a ``.gguf`` file gives the file's stem; an alias is its own name.
        """
        path = Path(alias)
        return path.stem if alias.endswith(".gguf") and path.is_file() else alias

    def _resolve(
        self,
        alias: str,
        device: str | None,
        progress: Callable[[int, int | None], None] | None,
    ) -> tuple[Path, dict[str, Any]]:
        if alias.endswith(".gguf") and Path(alias).is_file():
            return Path(alias), {"path": str(alias), "variant": Path(alias).name}
        resolved = resolve_and_fetch(alias, device=device, progress=progress)
        return Path(resolved.path), {
            "alias": resolved.alias,
            "variant": resolved.variant,
            "device": resolved.device,
            "device_reason": resolved.device_reason,
            "path": str(resolved.path),
            "verified": resolved.verified,
            "context_length": resolved.context_length,
            "n_gpu_layers": resolved.n_gpu_layers,
        }

    def unload(self, name: str) -> None:
        """Close one model: cancel its requests (``shutdown``), wait, free its memory."""
        model = self.get(name)
        with self._lock:
            self._models.pop(name, None)
        model.close()

    # -- lifecycle ---------------------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting, end every queued and running request with ``shutdown`` and
        wait up to ``timeout`` seconds for all of them to be released.

        Blocking. Returns False if some request was still held when ``timeout`` passed.
        New requests (and loads) raise ``RuntimeClosed`` from now on; ``close()`` then
        unloads the models.
        """
        with self._lock:
            self._closed = True
            models = list(self._models.values())
        for model in models:
            model.drain()
        deadline = None if timeout is None else time.monotonic() + timeout
        for model in models:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not model.wait_idle(left):
                return False
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel every request with ``shutdown``, wait for every release (at most
        ``timeout`` seconds), then unload every model."""
        self.drain(timeout)
        with self._lock:
            models = list(self._models.values())
            self._models.clear()
        for model in models:
            model.close(timeout)
        self._timer.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        import asyncio

        await asyncio.to_thread(self.close)
