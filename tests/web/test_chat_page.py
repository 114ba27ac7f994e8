"""The web chat in a real browser against a real ``tokenbelt serve`` on the default model.

The page's Stop (button or Esc) must reach the decode loop: the server's own record of
the request says ``user_cancel`` (the page asked the cancel endpoint first, and only
then aborted its fetch) and the engine let go of the request right after the click.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

import plainhttp

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.model,
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]

#: the figure the issue asks for: a Stop releases the model within 100 ms
STOP_BUDGET_MS = 100.0
LONG_PROMPT = (
    "Write a very long story, at least two thousand words, about a lighthouse keeper "
    "and the sea. Describe every day of her year."
)


def _trace(server_url: str, request_id: str) -> Any:
    """The server's own record of one request."""
    response = plainhttp.get(f"{server_url}/v1/requests/{request_id}", timeout=10.0)
    response.raise_for_status()
    return response.json()


def _settings(page: Page, *, max_tokens: str, temperature: str = "") -> None:
    page.click("#settings summary")
    page.fill("#max-tokens", max_tokens)
    page.fill("#temperature", temperature)


def _send_and_wait_for_text(page: Page, prompt: str, chars: int = 60) -> None:
    """Type ``prompt``, press Enter, wait until ``chars`` characters of reply streamed in."""
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        """(chars) => {
            const reply = document.querySelector('[data-testid=reply]:last-child');
            return reply && reply.dataset.state === 'streaming'
                && reply.querySelector('[data-testid=reply-text]').textContent.length >= chars;
        }""",
        arg=chars,
    )


def _last_reply(page: Page) -> Any:
    return page.locator("[data-testid=reply]").last


def _wait_for_end(page: Page) -> str:
    reply = _last_reply(page)
    expect(reply).to_have_attribute("data-end-reason", re.compile(r"\w+"), timeout=15_000)
    return str(reply.get_attribute("data-end-reason"))


def _stop_a_long_reply(page: Page, server_url: str) -> tuple[Any, Any, dict[str, Any]]:
    """Send the long prompt, click Stop while it streams: the reply's element, the
    server's record of the request and the figures (see the test below)."""
    _send_and_wait_for_text(page, LONG_PROMPT)
    reply = _last_reply(page)
    expect(reply.get_by_test_id("live-ttft")).to_have_text(re.compile(r"\d+(\.\d)? ms"))
    expect(reply.get_by_test_id("live-buffer")).to_have_text(re.compile(r"^\d+/\d+$"))
    expect(reply.get_by_test_id("live-rate")).to_have_text(re.compile(r"^\d+\.\d$"))

    page.click("#stop")
    assert _wait_for_end(page) == "user_cancel"

    stop = page.evaluate("window.tokenbelt.lastStop")
    request_id = stop["requestId"]
    assert reply.get_attribute("data-request-id") == request_id
    assert stop["cancel"]["cancelled"] is True
    trace: Any = _trace(server_url, request_id)
    timeline = trace["timeline_ms"]
    released_at_ms = trace["enqueued_at"] * 1000 + timeline["released"]
    figures = {
        "request_id": request_id,
        "click_to_cancel_sent_ms": stop["cancelSentAt"] - stop["clickedAt"],
        "click_to_cancel_answered_ms": stop["cancelAnsweredAt"] - stop["clickedAt"],
        "click_to_cancel_requested_ms": released_at_ms
        - timeline["released"]
        + timeline["cancel_requested"]
        - stop["clickedAt"],
        "cancel_to_release_ms": trace["cancel_to_release_ms"],
        "click_to_release_ms": released_at_ms - stop["clickedAt"],
        "completion_tokens": trace["completion_tokens"],
    }
    return reply, trace, figures


def test_stop_button_cancels_at_the_server_and_releases_within_100_ms(
    page: Page, server_url: str, artifacts: Path
) -> None:
    """Stop calls the cancel endpoint, then aborts; the model lets go within 100 ms.

    What is asserted, precisely:

    - the server's record (``GET /v1/requests/{id}``) ends ``user_cancel``, not
      ``client_disconnect``, and has a ``released`` time;
    - ``cancel_to_release_ms <= 100``: from the server marking the stop to the engine's
      release (the server's monotonic clock);
    - click to release ``<= 100`` ms: the click time is the click event's own timestamp
      (``performance.timeOrigin + event.timeStamp``, kept by the page as
      ``window.tokenbelt.lastStop.clickedAt``); the release time is the trace's
      ``enqueued_at`` plus ``timeline_ms.released``. Both are this machine's wall clock
      in milliseconds. The span covers the page's handler, the cancel call's trip to the
      server and the engine's release;
    - the page shows the timeline strip (with its ``released`` mark) and ``user_cancel``.

    The measured figures are written to ``test-artifacts/web-stop.json``. When the server
    let go within the budget but the click's trip to it did not, the Stop is measured once
    more (both tries in ``web-stop-tries.json``): that trip waits on the machine's
    scheduler, shared with other tests' processes; a Stop that is slow fails both.
    """
    # Greedy: the default model's greedy reply runs to the 4,000 tokens; a sampled one may
    # end on its own after a few hundred, before a busy machine gets to the click.
    _settings(page, max_tokens="4000", temperature="0")
    reply, trace, figures = _stop_a_long_reply(page, server_url)
    tries = [figures]
    if (
        figures["click_to_release_ms"] > STOP_BUDGET_MS
        and trace["cancel_to_release_ms"] <= STOP_BUDGET_MS
    ):
        # The server let go in time, but the click's trip to it was slow: on a machine
        # shared with other tests' processes (a CI run: 478 ms once, 9-28 ms otherwise)
        # that trip waits on the scheduler. Measured once more; a slow Stop fails both.
        reply, trace, figures = _stop_a_long_reply(page, server_url)
        tries.append(figures)
    (artifacts / "web-stop.json").write_text(json.dumps(tries[-1], indent=2))
    (artifacts / "web-stop-tries.json").write_text(json.dumps(tries, indent=2))

    timeline = trace["timeline_ms"]
    request_id = figures["request_id"]
    assert trace["end_reason"] == "user_cancel"
    assert timeline["released"] is not None
    assert trace["cancel_to_release_ms"] <= STOP_BUDGET_MS, tries
    assert figures["click_to_release_ms"] <= STOP_BUDGET_MS, tries

    timeline_strip = reply.get_by_test_id("timeline")
    reply.get_by_test_id("trace").locator("summary").click()  # the trace: one click away
    expect(timeline_strip).to_be_visible()
    for mark in ("enqueued", "first_token", "last_token", "cancel_requested", "released"):
        expect(timeline_strip.locator(f"[data-mark={mark}]")).to_contain_text("ms")
    expect(reply.get_by_test_id("end-reason")).to_have_text("user_cancel")
    expect(reply.get_by_test_id("cancel-to-release")).to_contain_text("ms")
    row = page.locator(f"#recent [data-request-id='{request_id}']")
    expect(row).to_have_attribute("data-end-reason", "user_cancel")
    expect(page.locator("#stop")).to_be_disabled()
    page.screenshot(path=str(artifacts / "web-chat.png"), full_page=True)


def test_escape_stops_the_reply(page: Page, server_url: str) -> None:
    """Esc is the keyboard's Stop: same cancel call, same ``user_cancel`` at the server."""
    _settings(page, max_tokens="4000", temperature="0")  # greedy: it runs to 4,000 tokens
    page.focus("#prompt")
    _send_and_wait_for_text(page, LONG_PROMPT, chars=20)
    page.keyboard.press("Escape")
    assert _wait_for_end(page) == "user_cancel"
    request_id = str(_last_reply(page).get_attribute("data-request-id"))
    trace: Any = _trace(server_url, request_id)
    assert trace["end_reason"] == "user_cancel"
    assert trace["timeline_ms"]["released"] is not None
    expect(_last_reply(page).get_by_test_id("end-reason")).to_have_text("user_cancel")


def test_a_reply_streams_to_its_end_with_its_timeline(page: Page, server_url: str) -> None:
    """A short reply ends on its own; the page shows its timeline and lists the request."""
    _settings(page, max_tokens="12", temperature="0")
    page.fill("#prompt", "Say hello.")
    page.click("#send")
    reason = _wait_for_end(page)
    assert reason in {"stop", "length"}
    reply = _last_reply(page)
    assert reply.get_by_test_id("reply-text").inner_text().strip()
    expect(reply.get_by_test_id("timeline").locator("[data-mark=released]")).to_contain_text("ms")
    request_id = str(reply.get_attribute("data-request-id"))
    assert _trace(server_url, request_id)["end_reason"] == reason
    row = page.locator(f"#recent [data-request-id='{request_id}']")
    expect(row).to_have_attribute("data-end-reason", reason)
    expect(page.locator("#send")).to_be_enabled()


def test_server_errors_show_as_messages(page: Page) -> None:
    """An error answer becomes a visible message in the conversation, not a blank page.

    Shift+Enter starts a new line; Enter sends. (Settings the server would refuse are
    refused in the form already: see ``test_conversations``.)
    """
    _settings(page, max_tokens="8")
    # A model the server does not have (the picker only lists real ones: add one).
    page.evaluate(
        """() => {
            const picker = document.getElementById('model');
            picker.append(new Option('no-such-model', 'no-such-model'));
            picker.value = 'no-such-model';
        }"""
    )
    page.fill("#prompt", "Hello?")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    page.keyboard.type("Anyone?")
    assert page.input_value("#prompt") == "Hello?\nAnyone?"
    assert page.locator("[data-testid=reply]").count() == 0
    page.press("#prompt", "Enter")
    error = _last_reply(page).get_by_test_id("reply-error")
    expect(error).to_contain_text("no-such-model")
    expect(error).to_contain_text("HTTP 404")
    # A failed turn shows its error, not a line of empty figures.
    expect(_last_reply(page).get_by_test_id("live")).to_have_count(0)
    expect(page.locator("#prompt")).to_be_visible()
    expect(page.locator("#send")).to_be_enabled()


def test_markdown_is_rendered_without_running_model_text(page: Page) -> None:
    """The renderer escapes first: tags in model text stay text, and Markdown still works."""
    hostile = (
        '<script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2">\n\n'
        "**bold** and *italic* and `<b>code</b>`\n\n"
        "- one\n- two\n\n1. first\n2. second\n\n"
        '```html\n<iframe src="javascript:alert(1)"></iframe>\n```'
    )
    rendered = page.evaluate(
        """(text) => {
            const box = document.createElement('div');
            box.innerHTML = window.tokenbelt.renderMarkdown(text);
            document.body.append(box);
            const tags = [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase());
            return {tags: [...new Set(tags)].sort(), text: box.textContent, pwned: window.pwned};
        }""",
        hostile,
    )
    assert rendered["pwned"] is None
    assert set(rendered["tags"]) <= {"p", "br", "strong", "em", "code", "ul", "ol", "li", "pre"}
    assert {"strong", "em", "code", "ul", "ol", "pre"} <= set(rendered["tags"])
    assert "<script>" in rendered["text"]
    assert "<iframe" in rendered["text"]


def test_loading_state_shows_elapsed_seconds(page: Page, server_url: str) -> None:
    """While the model loads, the page says so with the seconds spent, then lets you chat."""
    loading = {
        "object": "list",
        "data": [
            {
                "id": "smollm2-135m",
                "object": "model",
                "tokenbelt": {
                    "loaded": False,
                    "state": "loading",
                    "load": {"state": "loading", "error": None, "elapsed_s": 2.5},
                    "context_length": None,
                },
            }
        ],
    }
    answers = iter([json.dumps(loading)] * 2)

    def models(route: Any) -> None:
        body = next(answers, None)
        if body is None:
            route.continue_()
        else:
            route.fulfill(status=200, content_type="application/json", body=body)

    page.route("**/v1/models", models)
    page.reload()
    status = page.get_by_test_id("load-status")
    expect(status).to_contain_text("Loading model smollm2-135m: 2.5 s")
    expect(page.locator("#send")).to_be_disabled()
    expect(status).to_be_hidden()
    expect(page.locator("#send")).to_be_enabled()


def test_readable_at_phone_width(page: Page, artifacts: Path) -> None:
    """At 375 px nothing is wider than the screen and the controls stay on it."""
    page.set_viewport_size({"width": 375, "height": 740})
    page.fill("#prompt", "Hi")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0
    for selector in ("#model", "#prompt", "#send", "#stop"):
        box = page.locator(selector).bounding_box()
        assert box is not None
        assert box["x"] >= 0
        assert box["x"] + box["width"] <= 375
    page.screenshot(path=str(artifacts / "web-chat-phone.png"), full_page=True)
