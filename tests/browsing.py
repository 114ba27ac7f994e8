"""Opening the web chat in a real browser, for the browser tests."""

from __future__ import annotations

from collections.abc import Iterator

from playwright.sync_api import Browser, Page


def open_chat_page(
    browser: Browser, url: str, width: int = 1280, height: int = 800, *, clipboard: bool = False
) -> Iterator[Page]:
    """Yield a fresh page on the chat once its model works; fail on any page error."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(30_000)
    if clipboard:
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=url)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(url + "/")
        page.wait_for_function("!document.getElementById('send').disabled")
        yield page
        assert not errors, f"the page raised: {errors}"
    finally:
        context.close()
