"""Prometheus series after real traffic, and one JSON log line per finished request."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

import plainhttp
from tokenbelt import EndReason, Runtime, ScriptedEngine
from tokenbelt.belt import Trace
from tokenbelt.belt._trace import DEFAULT_RELEASE_LAG_THRESHOLD

from ..conftest import CHAT, NET, RawClient, ServeFactory, chat_body, scrape, value, words

HISTOGRAMS = (
    "tokenbelt_queue_time_seconds",
    "tokenbelt_time_to_first_token_seconds",
    "tokenbelt_inter_token_latency_seconds",
    "tokenbelt_e2e_request_latency_seconds",
    "tokenbelt_cancel_to_release_seconds",
)


def wait_lagging(trace: Trace) -> None:
    """Wait until the request has been stopped for longer than the release-lag threshold."""
    deadline = time.monotonic() + NET
    while trace.cancel_requested is None or (
        trace.clock() - trace.cancel_requested <= DEFAULT_RELEASE_LAG_THRESHOLD
    ):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_metrics_hold_every_series_after_traffic(serve: ServeFactory) -> None:
    gate = threading.Event()
    runtime = Runtime(keep_alive=None)
    runtime.add_engines("scripted", [ScriptedEngine(words(100_000), delay=0.002)])
    # Each step of this one waits on ``gate`` without watching the belt: a native
    # step that cannot be interrupted, so a stop reaches it late.
    runtime.add_engines("stuck", [ScriptedEngine(words(3), gate=gate)])
    served = serve(runtime)
    recorder = served.recorder

    ok = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(max_tokens=5), timeout=NET)
    assert ok.status_code == 200

    with RawClient(served.url) as client:  # client_disconnect
        client.send(CHAT, chat_body(stream=True, max_tokens=100_000))
        client.read_head()
        client.read_until(b"data: ")
    recorder.wait(recorder.nth(1), "released")

    with RawClient(served.url) as client:  # user_cancel
        client.send(CHAT, chat_body(stream=True, max_tokens=100_000))
        _, headers = client.read_head()
        client.read_until(b"data: ")
        plainhttp.post(f"{served.url}/v1/requests/{headers['x-request-id']}/cancel", timeout=NET)
        client.read_until(b"data: [DONE]")
    recorder.wait(recorder.nth(2), "released")

    try:
        with RawClient(served.url) as client:  # released late: a release-lag alert
            client.send(CHAT, chat_body(model="stuck", stream=True))
            stuck = recorder.nth(3)
            recorder.wait(stuck, "admitted")
            during = scrape(served)
            assert value(during, "tokenbelt_running_requests", model="stuck") == 1
            assert value(during, "tokenbelt_queue_depth", model="stuck") == 0
            plainhttp.post(f"{served.url}/v1/requests/{stuck.request_id}/cancel", timeout=NET)
            wait_lagging(stuck)
            gate.set()
            recorder.wait(stuck, "release_lag")
    finally:
        gate.set()
    recorder.wait(stuck, "released")

    samples = scrape(served)
    for reason, count in (("length", 1), ("client_disconnect", 1), ("user_cancel", 1)):
        assert (
            value(samples, "tokenbelt_requests_total", model="scripted", end_reason=reason) == count
        )
    assert value(samples, "tokenbelt_requests_total", model="stuck", end_reason="user_cancel") == 1
    assert value(samples, "tokenbelt_release_lag_alerts_total", model="stuck") == 1
    for name in HISTOGRAMS:
        assert f"{name}_bucket" in samples, name
        assert value(samples, f"{name}_count", model="scripted") >= 1, name
    assert value(samples, "tokenbelt_e2e_request_latency_seconds_count", model="scripted") == 3
    assert value(samples, "tokenbelt_cancel_to_release_seconds_count", model="scripted") == 2
    assert value(samples, "tokenbelt_cancel_to_release_seconds_sum", model="stuck") > (
        DEFAULT_RELEASE_LAG_THRESHOLD
    )
    for model in ("scripted", "stuck"):
        assert value(samples, "tokenbelt_running_requests", model=model) == 0
        assert value(samples, "tokenbelt_queue_depth", model=model) == 0
    assert value(samples, "tokenbelt_completion_tokens_total", model="scripted") >= 5
    # Every gap between two tokens is observed: 4 for the 5-token reply, and all of the
    # stopped requests' gaps too.
    assert len(recorder.nth(0).token_gaps) == 4
    gaps = sum(len(recorder.nth(n).token_gaps) for n in range(3))
    assert value(samples, "tokenbelt_inter_token_latency_seconds_count", model="scripted") == gaps
    assert stuck.end_reason is EndReason.USER_CANCEL


def test_one_json_log_line_per_finished_request(
    serve: ServeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenbelt.requests")
    served = serve(_runtime())
    ok = plainhttp.post(f"{served.url}{CHAT}", json=chat_body(max_tokens=4), timeout=NET)
    with RawClient(served.url) as client:
        client.send(CHAT, chat_body(model="slow", stream=True, max_tokens=100_000))
        client.read_head()
        client.read_until(b"data: ")
    gone = served.recorder.nth(1)
    served.recorder.wait(gone, "released")

    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tokenbelt.requests"]
    by_id = {line["request_id"]: line for line in lines}
    assert len(lines) == len(by_id) == 2, "exactly one line per request"

    done = by_id[ok.headers["x-request-id"]]
    assert done["event"] == "request"
    assert done["api"] == "openai"
    assert done["end_reason"] == "length"
    timeline = done["timeline_ms"]
    for point in ("enqueued", "first_token", "last_token", "released"):
        assert timeline[point] is not None, point
    assert timeline["enqueued"] <= timeline["first_token"] <= timeline["last_token"]
    assert timeline["last_token"] <= timeline["released"]
    assert done["queue_wait_ms"] is not None
    assert done["time_to_first_token_ms"] is not None
    assert done["completion_tokens"] == 4
    assert done["prompt_tokens"] > 0
    assert 1 <= done["buffer_peak"] <= 8

    left = by_id[gone.request_id]
    assert left["end_reason"] == "client_disconnect"
    assert left["cancel_to_release_ms"] is not None
    assert left["timeline_ms"]["cancel_requested"] is not None


def _runtime() -> Runtime:
    runtime = Runtime(keep_alive=None)
    runtime.add_engines("scripted", [ScriptedEngine(words(10), delay=0)])
    runtime.add_engines("slow", [ScriptedEngine(words(100_000), delay=0.002)])
    return runtime


def test_a_batch_engine_reports_the_prefix_cache_it_restored_from_disk() -> None:
    from prometheus_client import generate_latest

    from tokenbelt.engines import BatchStatistics
    from tokenbelt.server.core._metrics import Metrics

    stats = BatchStatistics(2, 0, 0, 0, 0, 0, 0, 0, 1, 2, restored_entries=1, restored_tokens=1025)
    metrics = Metrics(dict, lambda: [("m", stats)])
    text = generate_latest(metrics.registry).decode()
    found = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model") == "m"
    }
    assert found["tokenbelt_batch_prefix_cache_restored_entries_total"] == 1
    assert found["tokenbelt_batch_prefix_cache_restored_tokens_total"] == 1025
