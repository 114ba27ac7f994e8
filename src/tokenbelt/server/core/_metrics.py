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
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from ...belt import EndReason, TraceEvent, invariants
from ...engines import BatchStatistics, EngineStatistics, UpstreamStatistics, WorkerStatistics
from ...runtime import SchedulerStatistics

request_log = logging.getLogger("tokenbelt.requests")

# Seconds; fine at the low end, where cancel-to-release and token gaps live.
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

#: the label of requests no HTTP API announced
SDK = "sdk"
#: far more requests than can be queued or running at once
_LABELS_KEPT = 4096


class Metrics:
    """Turns trace events into Prometheus series and request log lines."""

    def __init__(
        self,
        stats: Callable[[], dict[str, SchedulerStatistics]],
        engines: Callable[[], list[tuple[str, EngineStatistics]]] = list,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_EngineCollector(engines))
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
        self.release_lag = Counter(
            "tokenbelt_release_lag_alerts",
            "Requests released more than the threshold after they were asked to stop.",
            ["model", "api"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "tokenbelt_queue_depth", "Requests waiting for a slot.", ["model"], registry=r
        )
        self.running = Gauge(
            "tokenbelt_running_requests", "Requests holding a slot.", ["model"], registry=r
        )
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

    def refresh_gauges(self) -> None:
        """Read queue depth and running requests from the schedulers (at scrape time)."""
        for name, s in self._stats().items():
            self.queue_depth.labels(name).set(s.queued)
            self.running.labels(name).set(s.running)

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
        itl = self.itl.labels(model, api)
        for gap in t.token_gaps:
            itl.observe(gap)
        request_log.info("%s", json.dumps({"event": "request", "api": api, **t.to_dict()}))


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
        "prefix_cache_hits": (
            "prefix_hits",
            "Requests that reused KV cells from the prefix cache.",
        ),
        "prefix_cached_tokens": (
            "prefix_cached_tokens",
            "Prompt tokens taken from the prefix cache instead of computed.",
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
    if invariants.enabled:
        yield CounterMetricFamily(
            "tokenbelt_invariant_violations",
            "Timeline invariants broken (checked with --check-invariants).",
            value=invariants.count(),
        )


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
