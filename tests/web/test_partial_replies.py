"""What the user saw stays: a stopped or interrupted reply is part of the conversation the
model sees (marked, and droppable), a reload mid-reply keeps the text shown, the trace is
one click away, and on a phone the messages get the screen. Screenshots at 1280x800 and
390x844 go to ``test-artifacts/``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Request, expect

from browsing import open_chat_page

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.model,
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]

LONG_PROMPT = (
    "Write a very long story, at least two thousand words, about a lighthouse keeper "
    "and the sea. Describe every day of her year."
)
SIZES = {"laptop": (1280, 800), "phone": (390, 844)}


@pytest.fixture(params=list(SIZES))
def sized(request: pytest.FixtureRequest, browser: Browser, server_url: str) -> Iterator[Page]:
    width, height = SIZES[request.param]
    yield from open_chat_page(browser, server_url, width, height)


def _long_replies(page: Page) -> None:
    page.click("#settings summary")
    page.fill("#max-tokens", "2000")
    page.click("#settings summary")


def _short_replies(page: Page) -> None:
    """Replies of at most 24 tokens: a busy machine still ends them in seconds."""
    page.click("#settings summary")
    page.fill("#max-tokens", "24")
    page.click("#settings summary")


def _send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _streamed(page: Page, words: int = 6) -> None:
    """Wait until the last reply is streaming and shows ``words`` words."""
    page.wait_for_function(
        """(words) => {
            const reply = document.querySelector('[data-testid=reply]:last-child');
            return reply && reply.dataset.state === 'streaming'
                && reply.querySelector('[data-testid=reply-text]').textContent
                     .trim().split(/\\s+/).length >= words;
        }""",
        arg=words,
    )


def _stop(page: Page) -> Any:
    reply = page.locator("[data-testid=reply]").last
    page.click("#stop")
    expect(reply).to_have_attribute("data-end-reason", "user_cancel", timeout=15_000)
    return reply


def _end(page: Page) -> None:
    """Stop the last reply if it still streams (Esc), and wait for its end, whichever."""
    page.keyboard.press("Escape")
    reply = page.locator("[data-testid=reply]").last
    expect(reply).to_have_attribute("data-end-reason", re.compile(r"\w+"), timeout=15_000)


def _stored_turns(page: Page) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = page.evaluate(
        """() => {
            const store = JSON.parse(localStorage.getItem('tokenbelt.conversations.v1'));
            return store.conversations.find((c) => c.id === store.current).turns;
        }"""
    )
    return turns


def _body_of_next_send(page: Page, text: str) -> dict[str, Any]:
    with page.expect_request(
        lambda r: r.url.endswith("/v1/chat/completions") and r.method == "POST"
    ) as caught:
        _send(page, text)
    request: Request = caught.value
    body: dict[str, Any] = json.loads(request.post_data or "{}")
    return body


def test_a_stopped_reply_stays_in_what_the_model_sees_until_dropped(
    sized: Page, artifacts: Path
) -> None:
    page = sized
    _long_replies(page)
    _send(page, LONG_PROMPT)
    _streamed(page)
    reply = _stop(page)
    mark = reply.get_by_test_id("partial")
    expect(mark).to_be_visible()
    expect(mark).to_have_attribute("data-kept", "true")
    partial = _stored_turns(page)[-1]["content"]
    assert len(partial.split()) >= 6

    body = _body_of_next_send(page, "Continue")
    assert body["messages"][-3:] == [
        {"role": "user", "content": LONG_PROMPT},
        {"role": "assistant", "content": partial},
        {"role": "user", "content": "Continue"},
    ]
    _streamed(page, 2)
    _end(page)
    size = "phone" if (page.viewport_size or {}).get("width", 0) < 720 else "laptop"
    page.screenshot(path=str(artifacts / f"web-partial-{size}.png"))

    # Dropped, the first partial reply is no longer sent; the second one still is.
    first = page.locator("[data-testid=reply]").first
    first.get_by_test_id("drop-partial").click()
    first = page.locator("[data-testid=reply]").first
    expect(first.get_by_test_id("partial")).to_have_attribute("data-kept", "false")
    expect(first.get_by_test_id("keep-partial")).to_be_visible()
    page.screenshot(path=str(artifacts / f"web-partial-dropped-{size}.png"))
    second = _stored_turns(page)[-1]["content"]
    body = _body_of_next_send(page, "And then?")
    assert {"role": "assistant", "content": partial} not in body["messages"]
    assert {"role": "user", "content": LONG_PROMPT} not in body["messages"]
    assert body["messages"][-3:] == [
        {"role": "user", "content": "Continue"},
        {"role": "assistant", "content": second},
        {"role": "user", "content": "And then?"},
    ]
    _end(page)


def test_a_reload_mid_reply_keeps_the_text_shown_and_marks_it_interrupted(
    sized: Page, artifacts: Path
) -> None:
    page = sized
    _long_replies(page)
    _send(page, LONG_PROMPT)
    _streamed(page, 12)
    shown = page.locator("[data-testid=reply-text]").last.inner_text()
    page.reload()
    page.wait_for_function("!document.getElementById('send').disabled")
    reply = page.locator("[data-testid=reply]").last
    expect(reply.get_by_test_id("interrupted")).to_be_visible()
    kept = reply.get_by_test_id("reply-text").inner_text()
    squash = re.compile(r"\s+")
    assert squash.sub(" ", kept).startswith(squash.sub(" ", shown).strip()), (shown, kept)
    expect(reply.get_by_test_id("partial")).to_have_attribute("data-kept", "true")
    size = "phone" if (page.viewport_size or {}).get("width", 0) < 720 else "laptop"
    page.screenshot(path=str(artifacts / f"web-interrupted-{size}.png"))
    # ...and it is part of what the model sees next.
    body = _body_of_next_send(page, "Continue")
    assert body["messages"][-2]["role"] == "assistant"
    assert squash.sub(" ", shown).strip() in squash.sub(" ", body["messages"][-2]["content"])
    _end(page)


def test_the_trace_is_one_click_away(sized: Page) -> None:
    page = sized
    _short_replies(page)
    _send(page, "Say hello.")
    reply = page.locator("[data-testid=reply]").last
    expect(reply).to_have_attribute("data-end-reason", re.compile(r"\w+"), timeout=30_000)
    trace = reply.get_by_test_id("trace")
    expect(trace).to_contain_text("tokens")
    expect(reply.get_by_test_id("timeline")).to_be_hidden()
    trace.locator("summary").click()
    expect(reply.get_by_test_id("timeline")).to_be_visible()
    expect(reply.get_by_test_id("timeline").locator("[data-mark=released]")).to_contain_text("ms")


def test_on_a_phone_the_messages_get_most_of_the_screen(
    browser: Browser, server_url: str, artifacts: Path
) -> None:
    pages = open_chat_page(browser, server_url, 390, 844)
    page = next(pages)
    try:
        _short_replies(page)
        _send(page, "Say hello.")
        expect(page.locator("[data-testid=reply]").last).to_have_attribute(
            "data-end-reason", re.compile(r"\w+"), timeout=30_000
        )
        log = page.locator("#log").bounding_box()
        assert log is not None
        assert log["height"] >= 0.7 * 844, log
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0
        page.screenshot(path=str(artifacts / "web-phone-390x844.png"))
    finally:
        next(pages, None)
