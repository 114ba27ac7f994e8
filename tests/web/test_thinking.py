"""A thinking model on the web page: its reasoning streams into a collapsed "Thinking"
box above the reply, and Stop during the thinking stops the request there."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

import plainhttp
from browsing import open_chat_page
from serving import serve_default_model

#: a safety net for the server's start, never an assertion
START_NET_S = 60.0

pytestmark = pytest.mark.model

STORY = "Write a long story about a dragon who learns to fly."


@pytest.fixture(scope="module")
def thinking_url(tmp_path_factory: pytest.TempPathFactory, thinking_model: Path) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("serve-thinking")
    with serve_default_model(tmp, START_NET_S, model=thinking_model) as url:
        yield url


@pytest.fixture
def thinking_page(browser: Browser, thinking_url: str) -> Iterator[Page]:
    yield from open_chat_page(browser, thinking_url)


def test_thinking_streams_collapsed_and_stop_ends_it_there(
    thinking_page: Page, thinking_url: str
) -> None:
    page = thinking_page
    page.click("#settings summary")
    page.fill("#max-tokens", "2000")
    page.fill("#prompt", STORY)
    page.press("#prompt", "Enter")
    reply = page.locator("[data-testid=reply]").last
    thinking = reply.get_by_test_id("thinking")
    expect(thinking.get_by_test_id("thinking-text")).to_have_text(re.compile(r"\w+ \w+ \w+"))
    assert thinking.get_attribute("open") is None  # collapsed while it streams
    assert reply.get_by_test_id("reply-text").inner_text() == ""  # no answer yet
    page.click("#stop")
    expect(reply).to_have_attribute("data-end-reason", "user_cancel", timeout=15_000)
    request_id = reply.get_attribute("data-request-id")
    record = plainhttp.get(f"{thinking_url}/v1/requests/{request_id}", timeout=10).json()
    assert record["end_reason"] == "user_cancel"
    assert record["reasoning"]["phase"] == "reasoning"
    assert record["timeline_ms"]["released"] is not None
    thinking.locator("summary").click()
    expect(thinking).to_have_attribute("open", "")
