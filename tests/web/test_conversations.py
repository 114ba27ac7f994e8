"""The web page as people use it, at a laptop's 1366 px and a phone's 390 px.

A real ``tokenbelt serve`` on the default model and Debian's Chromium. Conversations
live in the browser (``localStorage``), settings are checked in the form with the
server's own limits, the request panel shows this page's requests and is never clipped,
and Stop still reaches the decode loop. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

import plainhttp
from browsing import open_chat_page
from tokenbelt._defaults import DEFAULT_MAX_TOKENS

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.model,
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]

SIZES = {"laptop": (1366, 768), "phone": (390, 844)}
LONG_PROMPT = (
    "Write a very long story, at least two thousand words, about a lighthouse keeper "
    "and the sea. Describe every day of her year."
)


def _open(browser: Browser, server_url: str, size: str) -> Iterator[Page]:
    width, height = SIZES[size]
    yield from open_chat_page(browser, server_url, width, height, clipboard=True)


@pytest.fixture(params=list(SIZES))
def sized_page(request: pytest.FixtureRequest, browser: Browser, server_url: str) -> Iterator[Page]:
    yield from _open(browser, server_url, request.param)


@pytest.fixture
def laptop(browser: Browser, server_url: str) -> Iterator[Page]:
    yield from _open(browser, server_url, "laptop")


def _size(page: Page) -> str:
    viewport = page.viewport_size
    assert viewport is not None
    return "phone" if viewport["width"] < 720 else "laptop"


def _open_settings(page: Page) -> None:
    if page.locator("#settings").get_attribute("open") is None:
        page.click("#settings summary")


def _settings(page: Page, **values: str) -> None:
    _open_settings(page)
    for field, value in values.items():
        page.fill(f"#{field}", value)


def _ask(page: Page, text: str) -> str:
    """Send ``text``, wait for the reply's end; its request id."""
    before = page.locator("[data-testid=reply][data-end-reason]").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    expect(page.locator("[data-testid=reply][data-end-reason]")).to_have_count(
        before + 1, timeout=30_000
    )
    return str(page.locator("[data-testid=reply]").last.get_attribute("data-request-id"))


def _open_panel(page: Page, panel: str) -> None:
    if page.locator(f"#{panel}").get_attribute("open") is None:
        page.click(f"#{panel} summary")


def _overflowing(page: Page) -> list[str]:
    """Visible elements that stick out of the viewport (outside any scrolling box)."""
    result: list[str] = page.evaluate(
        """() => {
            const width = window.innerWidth;
            const scrolls = (e) => {
                for (let p = e.parentElement; p; p = p.parentElement) {
                    const s = getComputedStyle(p);
                    if (/(auto|scroll|hidden)/.test(s.overflowX) && p !== document.body
                        && p !== document.documentElement) return true;
                }
                return false;
            };
            const out = [];
            if (document.documentElement.scrollWidth > width) out.push('document');
            for (const e of document.body.querySelectorAll('*')) {
                const r = e.getBoundingClientRect();
                if (!r.width || !r.height || scrolls(e)) continue;
                if (r.left < -1 || r.right > width + 1) {
                    out.push(`${e.tagName.toLowerCase()}#${e.id}.${e.className}`);
                }
            }
            return out;
        }"""
    )
    return result


# -- conversations ---------------------------------------------------------------------------


def test_a_conversation_survives_a_reload_and_the_list_manages_it(
    sized_page: Page, artifacts: Path
) -> None:
    page = sized_page
    _settings(page, **{"max-tokens": "8", "temperature": "0"})
    _ask(page, "Say hello.")
    reply_text = page.get_by_test_id("reply-text").last.inner_text()
    page.reload()
    page.wait_for_function("!document.getElementById('send').disabled")
    expect(page.get_by_test_id("user-turn")).to_have_count(1)
    expect(page.get_by_test_id("user-turn")).to_contain_text("Say hello.")
    expect(page.get_by_test_id("reply")).to_have_count(1)
    assert page.get_by_test_id("reply-text").inner_text() == reply_text
    expect(page.get_by_test_id("figures")).to_have_count(1)
    assert page.input_value("#max-tokens") == "8", "settings survive the reload too"

    _open_panel(page, "conversations-panel")
    conversations = page.get_by_test_id("conversation")
    expect(conversations).to_have_count(1)
    expect(conversations.first).to_contain_text("Say hello.")
    page.click("#new-chat")
    expect(conversations).to_have_count(2)
    expect(page.get_by_test_id("user-turn")).to_have_count(0)
    _open_panel(page, "conversations-panel")
    page.get_by_test_id("conversation-open").filter(has_text="Say hello.").click()
    expect(page.get_by_test_id("user-turn")).to_contain_text("Say hello.")

    _open_panel(page, "conversations-panel")
    page.once("dialog", lambda dialog: dialog.accept("Greetings"))
    page.locator(
        "[data-testid=conversation][class=current] [data-testid=conversation-rename]"
    ).click()
    expect(page.get_by_test_id("conversation-open").filter(has_text="Greetings")).to_have_count(1)
    page.reload()
    _open_panel(page, "conversations-panel")
    expect(page.get_by_test_id("conversation-open").filter(has_text="Greetings")).to_have_count(1)
    page.screenshot(path=str(artifacts / f"web-conversations-{_size(page)}.png"), full_page=True)

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator(
        "[data-testid=conversation][class=current] [data-testid=conversation-delete]"
    ).click()
    expect(page.get_by_test_id("conversation")).to_have_count(1)
    expect(page.get_by_test_id("conversation-open").filter(has_text="Greetings")).to_have_count(0)


def _wait_for_a_new_reply(page: Page, old_request_id: str) -> None:
    """The last reply is another request than ``old_request_id``, and it has ended."""
    page.wait_for_function(
        """(old) => {
            const replies = document.querySelectorAll('[data-testid=reply]');
            const last = replies[replies.length - 1];
            return replies.length === 1 && last.dataset.endReason
                && last.dataset.requestId && last.dataset.requestId !== old;
        }""",
        arg=old_request_id,
    )


def test_regenerate_edit_and_copy(laptop: Page, server_url: str) -> None:
    page = laptop
    _settings(page, **{"max-tokens": "8", "temperature": "0"})
    first = _ask(page, "Say hello.")

    page.get_by_test_id("copy").click()
    expect(page.get_by_test_id("copy")).to_have_attribute("data-copied", "true")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == page.evaluate(
        "JSON.parse(localStorage.getItem('tokenbelt.conversations.v1'))"
        ".conversations[0].turns[1].content"
    )

    page.get_by_test_id("regenerate").click()
    _wait_for_a_new_reply(page, first)
    second = str(page.get_by_test_id("reply").get_attribute("data-request-id"))
    assert second != first
    expect(page.get_by_test_id("user-turn")).to_have_count(1)

    page.get_by_test_id("edit").click()
    box = page.get_by_test_id("edit-box")
    expect(box).to_be_focused()
    box.fill("Say goodbye.")
    box.press("Enter")
    _wait_for_a_new_reply(page, second)
    third = str(page.get_by_test_id("reply").get_attribute("data-request-id"))
    assert third not in (first, second)
    expect(page.get_by_test_id("user-turn")).to_have_count(1)
    expect(page.get_by_test_id("user-turn").locator(".content")).to_have_text("Say goodbye.")
    stored = page.evaluate("JSON.parse(localStorage.getItem('tokenbelt.conversations.v1'))")
    turns = stored["conversations"][0]["turns"]
    assert [t["role"] for t in turns] == ["user", "assistant"]
    assert turns[0]["content"] == "Say goodbye."
    assert turns[1]["requestId"] == third
    trace = plainhttp.get(f"{server_url}/v1/requests/{third}", timeout=10).json()
    assert trace["end_reason"] in ("stop", "length")


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max-tokens", "0", "a whole number from 1 to 1048576"),
        ("max-tokens", "2.5", "a whole number from 1 to 1048576"),
        ("max-tokens", "1048577", "a whole number from 1 to 1048576"),
        ("temperature", "3", "a number from 0 to 2"),
        ("temperature", "-0.5", "a number from 0 to 2"),
        ("top-p", "0", "more than 0 and at most 1"),
        ("top-p", "1.5", "more than 0 and at most 1"),
        ("seed", "-1", "a whole number from 0 to 4294967295"),
        ("seed", "4294967296", "a whole number from 0 to 4294967295"),
        ("stop-strings", "\n".join(f"s{i}" for i in range(17)), "At most 16 stop strings"),
    ],
)
def test_invalid_settings_are_refused_in_the_form(
    laptop: Page, field: str, value: str, message: str
) -> None:
    page = laptop
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url) if "chat/completions" in r.url else None)
    _settings(page, **{field: value})
    page.fill("#prompt", "Hello?")
    page.press("#prompt", "Enter")
    error = page.get_by_test_id(f"{field}-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text(message)
    expect(page.locator(f"#{field}")).to_have_attribute("aria-invalid", "true")
    expect(page.locator(f"#{field}")).to_be_focused()
    assert page.input_value("#prompt") == "Hello?", "the message waits for a fix"
    expect(page.get_by_test_id("reply")).to_have_count(0)
    assert not sent
    page.fill(f"#{field}", "")
    expect(error).to_be_hidden()
    expect(page.locator(f"#{field}")).not_to_have_attribute("aria-invalid", "true")


def test_the_form_uses_the_servers_limits_and_default(laptop: Page, server_url: str) -> None:
    schema = plainhttp.get(f"{server_url}/openapi.json", timeout=10).json()
    fields = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]

    def bounds(name: str) -> dict[str, Any]:
        (number,) = [s for s in fields[name]["anyOf"] if s.get("type") != "null"]
        keys = ("minimum", "maximum", "exclusiveMinimum", "maxItems")
        return {k: v for k, v in number.items() if k in keys}

    limits = laptop.evaluate("window.tokenbelt.limits")
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        page_bounds = {k: v for k, v in limits[name].items() if k != "integer"}
        assert page_bounds == bounds(name), name
        number = next(s for s in fields[name]["anyOf"] if s.get("type") != "null")
        assert limits[name].get("integer", False) == (number["type"] == "integer")
    # str | list[str] with max_length: the bound sits on the union (a list's length).
    (stop,) = [s for s in fields["stop"]["anyOf"] if s.get("type") != "null"]
    assert limits["stop"]["maxItems"] == stop["maxLength"]
    assert laptop.evaluate("window.tokenbelt.defaults.max_tokens") == DEFAULT_MAX_TOKENS
    assert laptop.get_attribute("#max-tokens", "placeholder") == str(DEFAULT_MAX_TOKENS)
    assert str(DEFAULT_MAX_TOKENS) in (laptop.text_content("#max-tokens-hint") or "")


def test_every_setting_reaches_the_server(laptop: Page) -> None:
    page = laptop
    bodies: list[Any] = []
    page.on(
        "request",
        lambda r: (
            bodies.append(json.loads(r.post_data or "{}")) if "chat/completions" in r.url else None
        ),
    )
    _settings(
        page,
        **{
            "system": "Be brief.",
            "max-tokens": "6",
            "temperature": "0.5",
            "top-p": "0.9",
            "seed": "7",
            "stop-strings": "###\nEND",
        },
    )
    _ask(page, "Hi")
    (body,) = bodies
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"]) == (
        6,
        0.5,
        0.9,
        7,
    )
    assert body["stop"] == ["###", "END"]


# -- figures, context, requests, layout ------------------------------------------------------


def test_each_reply_shows_its_figures_once_and_the_context_it_used(laptop: Page) -> None:
    page = laptop
    _settings(page, **{"max-tokens": "8", "temperature": "0"})
    _ask(page, "Say hello.")
    reply = page.get_by_test_id("reply").last
    expect(reply.get_by_test_id("figures")).to_have_count(1)
    expect(reply.get_by_test_id("live")).to_have_count(0)
    expect(page.get_by_test_id("context-text")).to_have_text(
        re.compile(r"^\d+ \+ \d+ of \d+ tokens$")
    )
    used = int(str(page.get_by_test_id("context").get_attribute("data-used")))
    size = int(str(page.get_by_test_id("context").get_attribute("data-size")))
    assert 0 < used < size


def test_a_reply_cut_at_max_tokens_says_so(laptop: Page) -> None:
    _settings(laptop, **{"max-tokens": "3"})
    _ask(laptop, LONG_PROMPT)
    reply = laptop.get_by_test_id("reply").last
    expect(reply).to_have_attribute("data-end-reason", "length")
    expect(reply.get_by_test_id("length-hint")).to_contain_text("3-token limit")


def test_the_request_panel_shows_this_page_unless_asked_for_all(
    laptop: Page, server_url: str
) -> None:
    page = laptop
    other = plainhttp.post(
        f"{server_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=30,
    ).headers["x-request-id"]
    _settings(page, **{"max-tokens": "4"})
    mine = _ask(page, "Hello")
    recent = page.get_by_test_id("recent")
    expect(recent.locator(f"[data-request-id='{mine}']")).to_have_count(1)
    expect(recent.locator(f"[data-request-id='{other}']")).to_have_count(0)
    page.check("#all-requests")
    expect(recent.locator(f"[data-request-id='{other}']")).to_have_count(1)
    page.click("#recent-panel summary")  # collapsible
    expect(recent).to_be_hidden()


def test_nothing_overflows_and_the_composer_sits_at_the_bottom(
    sized_page: Page, artifacts: Path
) -> None:
    page = sized_page
    _settings(page, **{"max-tokens": "16"})
    _ask(page, "Hello " + "x" * 200)
    _open_panel(page, "recent-panel")
    _open_panel(page, "conversations-panel")
    assert _overflowing(page) == []
    viewport = page.viewport_size
    assert viewport is not None
    prompt = page.locator("#prompt").bounding_box()
    assert prompt is not None
    assert viewport["height"] - (prompt["y"] + prompt["height"]) < 80, prompt
    picker = page.locator("#model").bounding_box()
    assert picker is not None
    assert picker["width"] >= min(0.6 * viewport["width"], 200), picker
    page.screenshot(path=str(artifacts / f"web-layout-{_size(page)}.png"), full_page=True)


def test_stop_still_records_user_cancel(sized_page: Page, server_url: str) -> None:
    page = sized_page
    # greedy: the reply runs to 4,000 tokens, a sampled one may end before the click
    _settings(page, **{"max-tokens": "4000", "temperature": "0"})
    page.fill("#prompt", LONG_PROMPT)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        """() => {
            const reply = document.querySelector('[data-testid=reply]:last-child');
            return reply && reply.dataset.state === 'streaming';
        }"""
    )
    page.click("#stop")
    reply = page.get_by_test_id("reply").last
    expect(reply).to_have_attribute("data-end-reason", "user_cancel")
    request_id = reply.get_attribute("data-request-id")
    trace = plainhttp.get(f"{server_url}/v1/requests/{request_id}", timeout=10).json()
    assert trace["end_reason"] == "user_cancel"
    assert trace["timeline_ms"]["released"] is not None


def test_load_progress_is_a_bar(laptop: Page) -> None:
    loading = {
        "object": "list",
        "data": [
            {
                "id": "smollm2-135m",
                "object": "model",
                "tokenbelt": {
                    "loaded": False,
                    "state": "loading",
                    "load": {
                        "state": "loading",
                        "error": None,
                        "elapsed_s": 1.5,
                        "download": {"received_bytes": 25_000_000, "total_bytes": 100_000_000},
                    },
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

    laptop.route("**/v1/models", models)
    laptop.reload()
    bar = laptop.get_by_test_id("load-progress")
    expect(bar).to_be_visible()
    assert bar.evaluate("(b) => [b.value, b.max]") == [25_000_000, 100_000_000]
    expect(laptop.get_by_test_id("load-status")).to_contain_text("downloaded 25.0 of 100.0 MB")
    expect(laptop.get_by_test_id("load-status")).to_be_hidden()


def test_every_control_has_a_name_and_the_keyboard_order_is_sensible(laptop: Page) -> None:
    page = laptop
    _open_settings(page)
    unnamed = page.evaluate(
        """() => [...document.querySelectorAll('input, select, textarea, button')]
            .filter((e) => e.offsetParent !== null)
            .filter((e) => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                           && !e.textContent.trim())
            .map((e) => e.id || e.outerHTML.slice(0, 60))"""
    )
    assert unnamed == []
    page.focus("#prompt")
    page.keyboard.press("Tab")
    expect(page.locator("#send")).to_be_focused()


def test_a_reload_in_the_middle_of_a_reply_keeps_the_question_and_says_so(laptop: Page) -> None:
    page = laptop
    _settings(page, **{"max-tokens": "4000"})
    page.fill("#prompt", LONG_PROMPT)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        """() => {
            const reply = document.querySelector('[data-testid=reply]:last-child');
            return reply && reply.dataset.state === 'streaming';
        }"""
    )
    page.reload()
    page.wait_for_function("!document.getElementById('send').disabled")
    expect(page.get_by_test_id("user-turn")).to_have_count(1)
    expect(page.get_by_test_id("interrupted")).to_be_visible()
    expect(page.get_by_test_id("regenerate")).to_be_enabled()


def test_the_request_panel_says_which_requests_ran_together(laptop: Page, server_url: str) -> None:
    """Two requests decoded at once (``serve`` batches four) name each other."""
    from concurrent.futures import ThreadPoolExecutor

    page = laptop
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}]}

    def ask(_: int) -> str:
        answer = plainhttp.post(
            f"{server_url}/v1/chat/completions",
            json={**body, "max_tokens": 24, "temperature": 0},
            timeout=60,
        )
        return answer.headers["x-request-id"]

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(ask, range(2))
    record = plainhttp.get(f"{server_url}/v1/requests/{first}", timeout=10).json()
    assert second in record["batched_with"]
    _open_panel(page, "recent-panel")
    page.check("#all-requests")
    row = page.get_by_test_id("recent").locator(f"[data-request-id='{first}']")
    expect(row.get_by_test_id("batched-with")).to_contain_text("ran with")
    expect(row.get_by_test_id("batched-with")).to_have_attribute(
        "title", re.compile(re.escape(second))
    )


def test_a_long_prompt_shows_how_far_it_was_read_and_the_phone_page_stays_on_screen(
    browser: Browser, server_url: str, artifacts: Path
) -> None:
    """At 390 px, with the settings and every panel open, a prompt of several prefill
    steps shows a bar that fills as the server reads it (``return_progress``), nothing
    sticks out of the screen, and the bar goes at the first token."""
    for page in _open(browser, server_url, "phone"):
        _settings(page, **{"max-tokens": "2", "temperature": "0"})
        for panel in ("conversations-panel", "recent-panel"):
            _open_panel(page, panel)
        # Every text the bar shows, as it shows it (a fast machine reads the prompt in
        # less time than a poll takes).
        page.evaluate(
            """() => {
                window.seenProgress = [];
                new MutationObserver(() => {
                    const text = document.querySelector('[data-testid=prompt-progress-text]');
                    if (text && text.textContent) window.seenProgress.push(
                        [text.textContent, text.getBoundingClientRect().right]);
                }).observe(document.body, {subtree: true, childList: true, characterData: true});
            }"""
        )
        # new words: no prefix cache (in memory or on disk) holds them
        words = " ".join(
            f"line {i} of log {uuid.uuid4().hex[:8]} says the job ran." for i in range(40)
        )
        page.fill("#prompt", words)
        page.press("#prompt", "Enter")
        expect(page.locator("[data-testid=reply][data-end-reason]")).to_have_count(
            1, timeout=60_000
        )
        seen = page.evaluate("window.seenProgress")
        texts = [text for text, _ in seen]
        assert any(re.match(r"reading the prompt: [1-9]\d* of \d+ tokens", t) for t in texts), seen
        assert all(right <= 390 for _, right in seen), seen
        expect(page.get_by_test_id("prompt-progress")).to_have_count(0)  # gone at the reply
        assert _overflowing(page) == []
        page.screenshot(path=str(artifacts / "web-prompt-progress-phone.png"), full_page=True)
