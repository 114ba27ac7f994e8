"""Prometheus series and the one-JSON-line-per-request log, fed by trace events.

Series follow Prometheus naming (base units, ``_seconds``, ``_total``). Each app
has its own registry, so two servers in one process never share counters. Series
counted per request carry the ``api`` the request came in on (``openai``, ``ollama``,
``anthropic``; ``sdk`` for a request made in-process on the server's runtime).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from ...belt import EndReason, Trace, TraceEvent, invariants
from ...engines import BatchStatistics, EngineStatistics, UpstreamStatistics, WorkerStatistics
from ...runtime import STALE_ENDS, ModelStatus, SchedulerStatistics

request_log = logging.getLogger("tokenbelt.requests")

# Seconds; fine at the low end, where cancel-to-release and token gaps live.
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

#: the label of requests no HTTP API announced
SDK = "sdk"
#: far more requests than can be queued or running at once
_LABELS_KEPT = 4096
#: distinct (route, status, reason) series of refusals, and the longest reason kept
_REFUSAL_SERIES = 512
_REASON_CHARS = 64


def _now_gauges(r: CollectorRegistry) -> tuple[Gauge, Gauge, Gauge]:
    """The gauges read at each scrape: queued and running requests, and the prompt
    tokens still to be read by requests whose prefill is under way."""
    return (
        Gauge("tokenbelt_queue_depth", "Requests waiting for a slot.", ["model"], registry=r),
        Gauge("tokenbelt_running_requests", "Requests holding a slot.", ["model"], registry=r),
        Gauge(
            "tokenbelt_prefill_tokens_left",
            "Prompt tokens still to be read by requests whose prefill is under way (a busy "
            "server reading a long prompt, not a hung one).",
            ["model"],
            registry=r,
        ),
    )


class Metrics:
    """Turns trace events into Prometheus series and request log lines."""

    def __init__(
        self,
        stats: Callable[[], dict[str, SchedulerStatistics]],
        engines: Callable[[], list[tuple[str, EngineStatistics]]] = list,
        models: Callable[[], list[ModelStatus]] = list,
        budget: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_EngineCollector(engines))
        r.register(_ModelCollector(models, budget))
        self.queue_time = Histogram(
            "tokenbelt_queue_time_seconds",
            "Time from enqueue to admission.",
            ["model", "api"],
            buckets=_SLOW,
            registry=r,
        )
        self.ttft = Histogram(
            "tokenbelt_time_to_first_token_seconds",
            "Time from enqueue to the first token (queue wait included).",
            ["model", "api"],
            buckets=_SLOW,
            registry=r,
        )
        self.itl = Histogram(
            "tokenbelt_inter_token_latency_seconds",
            "Gap between two consecutive tokens of a request, as produced.",
            ["model", "api"],
            buckets=_FAST,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenbelt_e2e_request_latency_seconds",
            "Time from enqueue to release.",
            ["model", "api"],
            buckets=_SLOW,
            registry=r,
        )
        self.cancel_to_release = Histogram(
            "tokenbelt_cancel_to_release_seconds",
            "Time from a stop (cancel, disconnect, deadline) to the engine's release.",
            ["model", "api"],
            buckets=_FAST,
            registry=r,
        )
        self.requests = Counter(
            "tokenbelt_requests",
            "Finished requests by end reason.",
            ["model", "api", "end_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenbelt_prompt_tokens", "Prompt tokens processed.", ["model", "api"], registry=r
        )
        self.completion_tokens = Counter(
            "tokenbelt_completion_tokens",
            "Completion tokens generated.",
            ["model", "api"],
            registry=r,
        )
        self.refusals = Counter(
            "tokenbelt_refused_requests",
            "Requests refused before any work (4xx, or 503 while loading or shutting down), "
            "by route, status and reason (the refused field, or the refusal's code).",
            ["route", "status", "reason"],
            registry=r,
        )
        self._refusal_series: set[tuple[str, int, str]] = set()
        self.release_lag = Counter(
            "tokenbelt_release_lag_alerts",
            "Requests released more than the threshold after they were asked to stop.",
            ["model", "api"],
            registry=r,
        )
        # Embedding and rerank requests (``kind``: embed, rerank), beside the series above.
        self.embedding_inputs = Counter(
            "tokenbelt_embedding_inputs",
            "Inputs of finished embedding and rerank requests.",
            ["model", "api", "kind"],
            registry=r,
        )
        self.embedding_tokens = Counter(
            "tokenbelt_embedding_tokens",
            "Input tokens of finished embedding and rerank requests.",
            ["model", "api", "kind"],
            registry=r,
        )
        self.embedding_seconds = Histogram(
            "tokenbelt_embedding_seconds",
            "Time from admission to release of an embedding or rerank request.",
            ["model", "api", "kind"],
            buckets=_SLOW,
            registry=r,
        )
        # Transcriptions (``kind``: transcribe): the audio served and how fast.
        self.audio_seconds = Counter(
            "tokenbelt_transcribed_audio_seconds",
            "Seconds of audio in released transcription requests.",
            ["model", "api"],
            registry=r,
        )
        self.real_time_factor = Histogram(
            "tokenbelt_transcription_real_time_factor",
            "A transcription's seconds from admission to release per second of audio.",
            ["model", "api"],
            buckets=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0),
            registry=r,
        )
        self.superseded, self.stale_tokens, self.completion_ttft = _completion_series(r)
        self.queue_depth, self.running, self.prefill_left = _now_gauges(r)
        self._stats = stats
        # request id -> api, set just before a request is submitted. Kept past the release
        # (a release-lag alert may follow it), bounded by forgetting the oldest.
        self._apis: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def label(self, request_id: str, api: str) -> None:
        """Say which API ``request_id`` came in on; call it before submitting the request."""
        with self._lock:
            self._apis[request_id] = api
            while len(self._apis) > _LABELS_KEPT:
                self._apis.popitem(last=False)

    def forget(self, request_id: str) -> None:
        """Drop the label of a request that was never enqueued (its submit raised)."""
        with self._lock:
            self._apis.pop(request_id, None)

    def _api(self, request_id: str) -> str:
        with self._lock:
            return self._apis.get(request_id, SDK)

    def refused(self, route: str, status: int, reason: str) -> None:
        """Count one refused request. A reason is a field name or a code; a client can send
        any field name, so past ``_REFUSAL_SERIES`` series new reasons count as ``other``."""
        reason = reason[:_REASON_CHARS]
        key = (route, status, reason)
        with self._lock:
            if key not in self._refusal_series:
                if len(self._refusal_series) >= _REFUSAL_SERIES:
                    key = (route, status, "other")
                else:
                    self._refusal_series.add(key)
        self.refusals.labels(key[0], str(status), key[2]).inc()

    def refresh_gauges(self, recent: Iterable[Trace] = ()) -> None:
        """Read queue depth and running requests from the schedulers, and the prefill
        still to do from the ``recent`` traces (at scrape time)."""
        left: dict[str, int] = {}
        for name, s in self._stats().items():
            self.queue_depth.labels(name).set(s.queued)
            self.running.labels(name).set(s.running)
            left[name] = 0
        for t in recent:
            if t.admitted is not None and t.first_token is None and t.released is None:
                model = t.model or ""
                left[model] = left.get(model, 0) + max(0, t.prompt_tokens - t.prompt_read)
        for name, tokens in left.items():
            self.prefill_left.labels(name).set(tokens)

    def observe(self, event: TraceEvent) -> None:
        """A trace observer: count a request once, at its release."""
        t = event.trace
        if event.kind == "release_lag":
            self.release_lag.labels(t.model or "", self._api(t.request_id)).inc()
            return
        if event.kind != "released":
            return
        model = t.model or ""
        api = self._api(t.request_id)
        reason = t.end_reason or EndReason.RUNTIME_ERROR
        self.requests.labels(model, api, reason.value).inc()
        self._count_completion(t, model, api)
        self.prompt_tokens.labels(model, api).inc(t.prompt_tokens)
        self.completion_tokens.labels(model, api).inc(t.completion_tokens)
        for hist, value in (
            (self.queue_time, t.queue_wait),
            (self.ttft, t.time_to_first_token),
            (self.e2e, t.end_to_end),
            (self.cancel_to_release, t.cancel_to_release),
        ):
            if value is not None:
                hist.labels(model, api).observe(value)
        if t.kind == "transcribe":
            self.audio_seconds.labels(model, api).inc(t.audio_seconds)
            if t.real_time_factor is not None:
                self.real_time_factor.labels(model, api).observe(t.real_time_factor)
        elif t.kind != "generate":
            self.embedding_inputs.labels(model, api, t.kind).inc(t.inputs)
            self.embedding_tokens.labels(model, api, t.kind).inc(t.prompt_tokens)
            if t.admitted is not None and t.released is not None:
                self.embedding_seconds.labels(model, api, t.kind).observe(t.released - t.admitted)
        else:
            itl = self.itl.labels(model, api)
            for gap in t.token_gaps:
                itl.observe(gap)
        request_log.info("%s", json.dumps({"event": "request", "api": api, **t.to_dict()}))

    def _count_completion(self, t: Trace, model: str, api: str) -> None:
        """The code-completion series: a supersede, the work done after a stale stop, a
        completion's first token (``CompletionTally`` counts the same per model)."""
        if t.end_reason is EndReason.SUPERSEDED:
            self.superseded.labels(model, api).inc()
        if t.end_reason in STALE_ENDS:
            self.stale_tokens.labels(model, api).inc(t.tokens_after_stop)
        if t.infill and t.time_to_first_token is not None:
            self.completion_ttft.labels(model, api).observe(t.time_to_first_token)


def _completion_series(r: CollectorRegistry) -> tuple[Counter, Counter, Histogram]:
    """What code completion costs and how fast it answers: superseded requests, the
    tokens computed after a request went stale, a completion's first token."""
    return (
        Counter(
            "tokenbelt_superseded_requests",
            "Requests ended by a newer request with their supersede key (the next keystroke's "
            "completion), queued or running.",
            ["model", "api"],
            registry=r,
        ),
        Counter(
            "tokenbelt_stale_tokens",
            "Tokens computed for a request after it was superseded or its client went away "
            "(prompt tokens read and tokens generated after the stop).",
            ["model", "api"],
            registry=r,
        ),
        Histogram(
            "tokenbelt_completion_first_token_seconds",
            "Keystroke to first token: a code completion's (fill in the middle) time from "
            "its arrival (enqueue) to its first token.",
            ["model", "api"],
            buckets=_FAST,
            registry=r,
        ),
    )


class _EngineCollector(Collector):
    """Every engine's own counters, read at scrape time from one snapshot per scrape
    (``statistics()`` of a worker engine reads its process's memory): the batch
    engines' steps, remote engines' upstreams, worker processes."""

    def __init__(self, engines: Callable[[], list[tuple[str, EngineStatistics]]]) -> None:
        self._engines = engines

    def collect(
        self,
    ) -> Iterator[CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily]:
        snapshot = self._engines()
        yield from _batch_families(
            {name: s for name, s in snapshot if isinstance(s, BatchStatistics)}
        )
        yield from _upstream_families(
            {name: list(s.upstreams) for name, s in snapshot if s.upstreams is not None}
        )
        yield from _worker_families(
            {name: s.worker for name, s in snapshot if s.worker is not None}
        )


class _ModelCollector(Collector):
    """Each served model's place, read at scrape time: loaded, pinned, its memory by
    part, its loads and evictions; and the memory budget they share."""

    def __init__(
        self, models: Callable[[], list[ModelStatus]], budget: Callable[[], int | None]
    ) -> None:
        self._models, self._budget = models, budget

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        loaded = GaugeMetricFamily(
            "tokenbelt_model_loaded", "1 while a model is loaded.", labels=["model"]
        )
        pinned = GaugeMetricFamily(
            "tokenbelt_model_pinned", "1 for a model never evicted.", labels=["model"]
        )
        memory = GaugeMetricFamily(
            "tokenbelt_model_memory_bytes",
            "What a loaded model takes: estimated weights, kv, cache and overhead, the "
            "measured resident set, and the total the budget counts.",
            labels=["model", "part"],
        )
        loads = CounterMetricFamily(
            "tokenbelt_model_loads", "Loads of a model that completed.", labels=["model"]
        )
        evictions = CounterMetricFamily(
            "tokenbelt_model_evictions",
            "Unloads of an idle model to make room for another (the memory budget).",
            labels=["model"],
        )
        for m in self._models():
            loaded.add_metric([m.name], 1 if m.state == "ready" else 0)
            pinned.add_metric([m.name], 1 if m.pinned else 0)
            loads.add_metric([m.name], m.loads)
            evictions.add_metric([m.name], m.evictions)
            use = m.memory
            if use is None:
                continue
            parts = {"weights": use.weights, "kv": use.kv, "cache": use.cache}
            parts |= {"overhead": use.overhead, "total": use.total}
            if use.measured is not None:
                parts["measured"] = use.measured
            for part, value in parts.items():
                memory.add_metric([m.name, part], value)
        yield from (loaded, pinned, memory, loads, evictions)
        limit = self._budget()
        if limit is not None:
            yield GaugeMetricFamily(
                "tokenbelt_memory_budget_bytes", "The memory all loaded models share.", limit
            )


def _batch_families(
    batches: dict[str, BatchStatistics],
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The batch engines' counters (they count every step)."""
    series: dict[str, tuple[str, str]] = {
        "steps": ("steps", "Batched decode steps."),
        "step_sequences": (
            "sequences_stepped",
            "Sequences summed over batched steps (divide by steps: sequences per step).",
        ),
        "step_tokens": (
            "tokens_stepped",
            "Tokens summed over batched steps (divide by steps: tokens per step).",
        ),
        "aborted_steps": ("aborted_steps", "Steps aborted for a stop."),
        "stop_aborted_steps": (
            "stop_aborted_steps",
            "Steps aborted because they ran on past a stop's bound (stop_abort_after).",
        ),
        "prefix_cache_hits": (
            "prefix_hits",
            "Requests that reused KV cells from the prefix cache.",
        ),
        "prefix_cached_tokens": (
            "prefix_cached_tokens",
            "Prompt tokens taken from the prefix cache instead of computed.",
        ),
        "draft_tokens": (
            "draft_tokens",
            "Prompt-lookup draft tokens verified in batched steps.",
        ),
        "draft_accepted_tokens": (
            "accepted_draft_tokens",
            "Draft tokens the sampler accepted (each one a token without a step of its own).",
        ),
        "prefix_cache_restored_entries": (
            "restored_entries",
            "Prefix-cache entries read back from disk when the model loaded.",
        ),
        "prefix_cache_restored_tokens": (
            "restored_tokens",
            "Tokens of the prefix-cache entries read back from disk when the model loaded.",
        ),
    }
    for name, (field, doc) in series.items():
        family = CounterMetricFamily(f"tokenbelt_batch_{name}", doc, labels=["model"])
        for model, b in batches.items():
            family.add_metric([model], getattr(b, field))
        yield family
    threads = GaugeMetricFamily(
        "tokenbelt_engine_threads", "llama.cpp threads of the latest step.", labels=["model"]
    )
    for model, b in batches.items():
        threads.add_metric([model], b.threads)
    yield threads
    yield from _draft_families(batches)
    if invariants.enabled:
        yield CounterMetricFamily(
            "tokenbelt_invariant_violations",
            "Timeline invariants broken (checked with --check-invariants).",
            value=invariants.count(),
        )


def _draft_families(
    batches: dict[str, BatchStatistics],
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """Why drafting was on or off, per request, and the row costs it weighs."""
    decisions = CounterMetricFamily(
        "tokenbelt_draft_requests",
        "Requests by why prompt-lookup drafting was on or off for them: on (drafts "
        "verified), no_gain (drafts found, but their measured acceptance never paid the "
        "rows), nothing_to_copy, constrained (a grammar or a thinking phase), asked_off.",
        labels=["model", "decision"],
    )
    rows = GaugeMetricFamily(
        "tokenbelt_draft_row_cost",
        "What a step of this many tokens costs over a one-token step, as measured here "
        "(drafting verifies a draft's tokens as extra rows of a step).",
        labels=["model", "rows"],
    )
    for model, b in batches.items():
        for decision, count in sorted(b.draft_decisions.items()):
            decisions.add_metric([model, decision], count)
        for n, cost in b.row_costs().items():
            rows.add_metric([model, str(n)], round(cost, 3))
    yield decisions
    yield rows


def _upstream_families(
    upstreams: dict[str, list[UpstreamStatistics]],
) -> Iterator[CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily]:
    """Remote engines' upstreams: load, errors, ejections, TTFT."""
    labels = ["model", "upstream"]
    in_flight = GaugeMetricFamily(
        "tokenbelt_upstream_in_flight", "Requests an upstream holds now.", labels=labels
    )
    ejected = GaugeMetricFamily(
        "tokenbelt_upstream_ejected", "1 while an upstream is taken out.", labels=labels
    )
    requests = CounterMetricFamily(
        "tokenbelt_upstream_requests", "Requests sent to an upstream.", labels=labels
    )
    errors = CounterMetricFamily(
        "tokenbelt_upstream_errors", "Requests an upstream refused or failed.", labels=labels
    )
    ejections = CounterMetricFamily(
        "tokenbelt_upstream_ejections", "Times an upstream was taken out.", labels=labels
    )
    ttft = SummaryMetricFamily(
        "tokenbelt_upstream_time_to_first_token_seconds",
        "Seconds from sending a request to an upstream to its first token.",
        labels=labels,
    )
    for model, ups in upstreams.items():
        for u in ups:
            key = [model, u.url]
            in_flight.add_metric(key, u.in_flight)
            ejected.add_metric(key, 1 if u.ejected else 0)
            requests.add_metric(key, u.requests)
            errors.add_metric(key, u.errors)
            ejections.add_metric(key, u.ejections)
            ttft.add_metric(key, u.ttft_count, u.ttft_sum)
    yield from (in_flight, ejected, requests, errors, ejections, ttft)


def _worker_families(
    workers: dict[str, WorkerStatistics],
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """Engine worker processes: pid, memory, restarts, last crash."""
    labels = ["model"]
    up = GaugeMetricFamily(
        "tokenbelt_worker_up", "1 while a model's worker process is ready.", labels=labels
    )
    pid = GaugeMetricFamily(
        "tokenbelt_worker_pid", "Process id of a model's worker process.", labels=labels
    )
    rss = GaugeMetricFamily(
        "tokenbelt_worker_resident_memory_bytes",
        "Resident memory of a model's worker process.",
        labels=labels,
    )
    restarts = CounterMetricFamily(
        "tokenbelt_worker_restarts",
        "Worker processes started after the first (each after a crash).",
        labels=labels,
    )
    crash = GaugeMetricFamily(
        "tokenbelt_worker_last_crash_info",
        "Why a model's latest worker process died (the label); always 1.",
        labels=["model", "cause"],
    )
    for model, w in workers.items():
        up.add_metric([model], 1 if w.state == "ready" else 0)
        if w.pid is not None:
            pid.add_metric([model], w.pid)
        if w.rss_bytes is not None:
            rss.add_metric([model], w.rss_bytes)
        restarts.add_metric([model], w.restarts)
        if w.last_crash is not None:
            crash.add_metric([model, w.last_crash], 1)
    yield from (up, pid, rss, restarts, crash)
