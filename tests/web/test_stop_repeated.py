"""Twenty Stops in a row: every one is ``user_cancel`` in the log, the metrics and the record.

A busy machine once let a Stop reach the request log as ``"end_reason": null`` and the
metrics as ``runtime_error`` (the end reason was recorded after the release could be
seen). The server runs with ``--check-invariants`` and an ``info`` request log.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

import plainhttp
from browsing import open_chat_page
from serving import serve_default_model

CHROMIUM = Path("/usr/bin/chromium")
STOPS = 20
LONG_PROMPT = "Write a very long story about a lighthouse keeper and the sea."

pytestmark = [
    pytest.mark.model,
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]


@pytest.fixture(scope="module")
def logged_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("serve-stops")
    extra = ("--log-level", "info", "--check-invariants")
    with serve_default_model(tmp, 60.0, extra) as url:
        yield url, tmp / "serve.log"


def _metric(url: str, name: str, reason: str | None = None) -> float:
    text = plainhttp.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (reason is None or f'end_reason="{reason}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_twenty_stops_are_each_user_cancel_everywhere(
    browser: Browser, logged_server: tuple[str, Path]
) -> None:
    url, log = logged_server
    before = _metric(url, "tokenbelt_requests_total", "user_cancel")
    pages = open_chat_page(browser, url)
    page: Page = next(pages)
    ids: list[str] = []
    try:
        page.click("#settings summary")
        page.fill("#max-tokens", "2000")
        for _ in range(STOPS):
            page.fill("#prompt", LONG_PROMPT)
            page.press("#prompt", "Enter")
            reply = page.locator("[data-testid=reply]").last
            # A busy machine may take seconds for a first token: a wider net than 5 s.
            expect(reply).to_have_attribute("data-state", "streaming", timeout=30_000)
            expect(reply.get_by_test_id("reply-text")).to_have_text(re.compile(r"\w+ \w+"))
            page.click("#stop")
            expect(reply).to_have_attribute("data-end-reason", "user_cancel", timeout=15_000)
            ids.append(str(reply.get_attribute("data-request-id")))
            # A stopped reply stays in the conversation unless dropped: dropped, each
            # question is asked afresh (the prompt does not grow by twenty replies).
            reply.get_by_test_id("drop-partial").click()
    finally:
        next(pages, None)  # no page errors, then the browser context is closed
    assert len(set(ids)) == STOPS
    records: dict[str, Any] = {}
    for request_id in ids:
        record = plainhttp.get(f"{url}/v1/requests/{request_id}", timeout=10).json()
        records[request_id] = record
        assert record["end_reason"] == "user_cancel", record
        assert record["timeline_ms"]["released"] is not None
    after = _metric(url, "tokenbelt_requests_total", "user_cancel")
    assert after - before == STOPS
    assert _metric(url, "tokenbelt_invariant_violations_total") == 0
    lines = [json.loads(line.split("tokenbelt.requests: ", 1)[1]) for line in _request_lines(log)]
    logged = {entry["request_id"]: entry["end_reason"] for entry in lines}
    assert all(logged.get(request_id) == "user_cancel" for request_id in ids), logged


def _request_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if '"event": "request"' in line]
