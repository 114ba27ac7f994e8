"""The runtime: the application's handle on every loaded model."""

from __future__ import annotations

import difflib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._defaults import (
    DEFAULT_CACHE_ENTRIES,
    DEFAULT_CAPACITY,
    DEFAULT_N_CTX,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_SLOTS,
)
from .._errors import (
    InvalidArgument,
    ModelError,
    RuntimeClosed,
    UnknownModel,
    UpstreamUnavailable,
)
from ..belt import (
    RANGES,
    DeadlineTimer,
    Limits,
    Observer,
    check_capacity,
    check_duration,
    check_keep_alive,
)
from ..engines import (
    DEFAULT_STOP_GRACE,
    ISOLATIONS,
    Engine,
    LlamaConfig,
    RemoteEngine,
    Upstream,
    UpstreamModel,
    UpstreamPool,
    build,
    default_threads,
    list_models,
)
from ..models import (
    DEFAULT_ALIAS,
    NAME_PATTERN,
    find_remote,
    is_speech_model,
    read_gguf_info,
    resolve_and_fetch,
)
from ._memory import MemoryBudget, estimate, sized
from ._model import Model
from ._transcribe import load_speech

logger = logging.getLogger("tokenbelt.runtime")

#: the smallest context a sequence may have: a chat template, a short turn and a reply
MIN_N_CTX = int(RANGES["n_ctx"].low)


def trained_context(path: Path) -> int | None:
    """The context a GGUF file says its model was trained on (None: not said, or the
    file cannot be read; its load then says why)."""
    try:
        return read_gguf_info(path).context_length
    except ModelError:
        return None


def context_for(n_ctx: int | None, trained: int | None, kind: str = "chat") -> int:
    """The context a model loads at: ``n_ctx`` as given, else what it was trained on
    (``DEFAULT_N_CTX`` if it does not say; its load then lowers that until its KV cache
    fits, ``context_that_fits``). An embedding or rerank model takes at most what it was
    trained on (its inputs may hold no more). A chat model given more than it was trained
    on is refused (unless ``force_n_ctx``): by its load, and by ``tokenbelt serve``
    before it binds."""
    if n_ctx is None:
        return trained or DEFAULT_N_CTX
    if trained and kind != "chat":
        return min(n_ctx, trained)
    return n_ctx


def check_n_ctx(value: int) -> int:
    """Reject an ``n_ctx`` outside ``RANGES["n_ctx"]`` (the SDK's and the CLI's check):
    too small to hold a prompt, or past the largest context any model runs."""
    return check_capacity(value, name="n_ctx")


def _check_not_per_model(engine: LlamaConfig, slots: int, n_ctx: int) -> None:
    """``slots`` and ``n_ctx`` are each model's own (``Runtime(slots=...)``,
    ``load(slots=...)``): an engine configuration that sets them otherwise is refused,
    not overridden in silence."""
    default = LlamaConfig()
    for field, own in (("slots", slots), ("n_ctx", n_ctx)):
        given = getattr(engine, field)
        if given not in (getattr(default, field), own):
            raise InvalidArgument(
                f"{field} is each model's own: give Runtime({field}=...) or "
                f"load({field}=...), not LlamaConfig({field}={given})",
                param=field,
            )


class Runtime:
    """Catalog, cache and loaded models; a context manager (sync and async).

    Defaults given here apply to every model it loads: ``slots`` (sequences
    batched in one context; each may hold ``n_ctx`` tokens), ``queue_size`` (the
    bounded admission queue),
    ``capacity`` (belt length: how far generation may run ahead of a reader),
    ``limits`` (deadlines) and ``keep_alive`` (seconds idle before a model is
    unloaded; ``None`` keeps it). ``n_ctx`` is at least ``MIN_N_CTX`` (room for a
    chat template and a short turn) and at most what the model was trained on, unless
    the engine's ``force_n_ctx``; not given, it is ``DEFAULT_N_CTX`` (4096) or what each
    model was trained on, whichever is less.
    ``engine`` is how each model runs: a ``LlamaConfig`` (threads, prompt chunking, the
    prefix cache in memory and on disk, the KV cache's type, drafting, ``decode_nice``;
    its docstring says what each does), or its fields as keywords
    (``Runtime(kv_type="q8_0", draft="lookup")``), over ``engine`` or the defaults. Each
    load fills in the model's own ``slots``, ``n_ctx``, name and pooling.
    ``prefix_cache=False`` (``cache_entries=0``) computes every prompt in full instead of
    reusing the KV cells of an earlier or running one with the same start, so a prompt's
    arithmetic depends only on its batch, not on what ran before.
    ``isolation`` says where a loaded model runs: ``"thread"`` (in this process, the
    cheapest path) or ``"process"`` (a worker process per model: a native crash ends
    that model's running requests with ``runtime_error`` instead of this process, the
    worker restarts, and a stop not honoured within ``stop_grace`` seconds kills it).
    ``memory_budget`` (bytes; None, the default: no limit) bounds what every loaded
    model takes together: a load that would pass it first unloads idle models, least
    recently used first (``MemoryBudget``); one that cannot fit raises ``OverBudget``.
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
        n_ctx: int | None = None,
        isolation: str = "thread",
        stop_grace: float = DEFAULT_STOP_GRACE,
        observers: Sequence[Observer] = (),
        memory_budget: int | None = None,
        engine: LlamaConfig | None = None,
        prefix_cache: bool | None = None,
        **engine_options: Any,
    ) -> None:
        if isolation not in ISOLATIONS:
            raise InvalidArgument(
                f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}"
            )
        self.slots = check_capacity(slots, name="slots")
        self.queue_size = check_capacity(queue_size, name="queue_size")
        self.capacity = check_capacity(capacity)
        self.limits = limits or Limits()
        self.keep_alive = check_keep_alive(keep_alive)
        #: each request's context; given (not the default), a model trained on less refuses it
        self.n_ctx = check_n_ctx(n_ctx) if n_ctx is not None else DEFAULT_N_CTX
        self._n_ctx_given = n_ctx is not None
        if prefix_cache is not None:
            engine_options["cache_entries"] = DEFAULT_CACHE_ENTRIES if prefix_cache else 0
        if engine is not None:
            _check_not_per_model(engine, self.slots, self.n_ctx)
        #: how every model it loads runs (each load sets its own slots, context and name;
        #: these are the runtime's defaults for them)
        self.engine = LlamaConfig.of(engine, slots=self.slots, n_ctx=self.n_ctx, **engine_options)
        self._observers: list[Observer] = list(observers)
        self.isolation = isolation
        grace = check_duration("stop_grace", stop_grace, allow_zero=False)
        if grace is None:
            raise InvalidArgument("stop_grace must be a number of seconds, got None")
        self.stop_grace = grace
        #: the memory every loaded model shares (``limit`` None: unbounded)
        self.budget = MemoryBudget(memory_budget)
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
        """The model called ``name``: the registered one, else ``make()``'s. Two callers
        racing to register one name get the same model (the loser's is closed)."""
        with self._lock:
            if self._closed:
                raise RuntimeClosed("the runtime is closed")
            existing = self._models.get(name)
        if existing is not None:
            return existing
        model = make()
        with self._lock:
            closed = self._closed
            existing = self._models.get(name)
            if not closed and existing is None:
                self._models[name] = model
                return model
        model.close()
        if closed:
            raise RuntimeClosed("the runtime is closed")
        assert existing is not None
        return existing

    def _forget(self, name: str, model: Model) -> None:
        with self._lock:
            if self._models.get(name) is model:
                del self._models[name]
        model.close()

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
        n_ctx: int | None = None,
        pin: bool = False,
        lazy: bool = False,
        load_timeout: float | None = None,
        progress: Callable[[int, int | None], None] | None = None,
        **options: Any,
    ) -> Model:
        """Resolve ``alias`` to a variant for this machine, fetch and verify it, load it.

        Blocks while downloading and loading. ``load_timeout`` (or
        ``limits.load``) bounds the load: ``LoadTimeout`` when it passes. An unknown
        alias raises ``UnknownModel`` listing close matches; there is no fallback
        to another model. A path to a ``.gguf`` file loads that file. Loading an
        alias that is already loaded returns the loaded model; concurrent loads of one
        alias make one load, and all of them get its model or its error. A remote
        entry of the user catalog (``tokenbelt models add-remote``) is served by its
        upstreams (``add_remote``).

        ``slots``, ``n_ctx`` and ``keep_alive`` are this model's own (default: the
        runtime's). ``pin``: never unloaded to make room for another model. ``lazy``:
        register it now (an unknown alias still fails now) and fetch and load it on its
        first request. With a ``memory_budget``, the load first unloads idle models
        until the estimate of this one fits, or raises ``OverBudget``.
        """
        if is_speech_model(alias):  # a Whisper model: its own engine, in a worker
            return load_speech(
                self, alias, pin=pin, lazy=lazy, load_timeout=load_timeout, **options
            )
        remote = find_remote(alias) if NAME_PATTERN.match(alias) else None
        if remote is not None:
            # A model served elsewhere: nothing to download or load here.
            return self.add_remote(alias, remote.upstreams(), **options)
        n_slots = check_capacity(slots, name="slots") if slots is not None else self.slots
        timeout = load_timeout if load_timeout is not None else self.limits.load
        name = self.name_for(alias)
        info = self._describe(alias, device)

        if n_ctx is not None:
            n_ctx = check_n_ctx(n_ctx)
        elif self._n_ctx_given:
            n_ctx = self.n_ctx
        given = n_ctx is not None
        n_ctx = context_for(n_ctx, info.get("context_length"), info.get("kind", "chat"))
        config = LlamaConfig.of(
            self.engine,
            slots=n_slots,
            n_ctx=n_ctx,
            name=name,
            n_gpu_layers=info.get("n_gpu_layers", 0),
            pooling=info.get("pooling"),
        )
        threads, threads_batch = default_threads()
        info.update(
            slots=n_slots,
            n_ctx_per_seq=n_ctx,
            threads=config.n_threads or threads,
            threads_batch=config.n_threads_batch or threads_batch,
            prefill_chunk=config.prefill_chunk,
            prefill_gap=config.prefill_gap,
            kv_type=config.kv_type,
            decode_nice=config.decode_nice,
            isolation=self.isolation,
        )

        def factory() -> list[Engine]:
            nonlocal config
            path, resolved = self._resolve(alias, device, progress)  # may download
            info.update(resolved)
            config = sized(config, path, given=given, trained=info.get("context_length"))
            info.update(n_ctx_per_seq=config.n_ctx, cache_tokens=config.cache_tokens)
            need = estimate(
                path,
                slots=n_slots,
                n_ctx=config.n_ctx,
                cache_tokens=config.cache_tokens if config.prefix_cache else 0,
                kv_type=config.kv_type,
            )
            # Plain numbers (the info is JSON in /v1/models): ``Model.memory()`` reads them.
            info["memory_estimate"] = need.parts()
            # One load at a time counts the room left, and takes it.
            with self.budget.lock:
                self.budget.make_room(name, need, self.models.values())
                engine = build(
                    path,
                    config,
                    isolation=self.isolation,
                    load_timeout=timeout,
                    stop_grace=self.stop_grace,
                )
                return [engine]

        model = self._register(
            name,
            lambda: self._model(name, factory, info=info, load=False, pinned=pin, **options),
        )
        if not lazy:
            try:
                model.ensure_loaded()
            except BaseException:
                if not model.loads:  # never loaded: not registered, as if never asked
                    self._forget(name, model)
                raise
        return model

    def _describe(self, alias: str, device: str | None) -> dict[str, Any]:
        """What is known of ``alias`` before fetching it: the catalog's entry (its kind,
        context, pooling), or the file's name. Raises ``UnknownModel`` for an alias the
        catalog does not have."""
        if alias.endswith(".gguf") and Path(alias).is_file():
            return {
                "path": str(alias),
                "variant": Path(alias).name,
                "context_length": trained_context(Path(alias)),
            }
        from ..models import Catalog, Home, ModelCache, choose_variant

        home = Home.from_env()
        choice = choose_variant(Catalog.load(home), alias, device=device, cache=ModelCache(home))
        entry = choice.entry
        return {
            "alias": entry.alias,
            "variant": choice.variant.id,
            "device": choice.device,
            "n_gpu_layers": 0 if choice.device == "cpu" else -1,
            "context_length": entry.context_length,
            "kind": entry.kind,
            "pooling": entry.pooling,
            "matryoshka": list(entry.matryoshka),
        }

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
            "kind": resolved.kind,
            "pooling": resolved.pooling,
            "matryoshka": list(resolved.matryoshka),
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
