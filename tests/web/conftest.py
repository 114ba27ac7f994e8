"""A real ``tokenbelt serve`` on the default model, and a real headless Chromium.

The server runs as a subprocess on 127.0.0.1 and an ephemeral port, exactly as a user
starts it; the browser is Debian's Chromium driven by Playwright. Both are shared by all
the browser tests (starting them dominates the run; each test has its own page and browser
context, so no cookie, storage or route crosses tests) and always shut down.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from browsing import open_chat_page
from serving import serve_default_model

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
#: a safety net for the server's start, never an assertion
START_NET_S = 60.0


# Package scope, not session: Playwright's sync API keeps its event loop (on greenlets) in
# the main thread while it runs, and a test of another package in the same process (a
# pytest-xdist worker takes files in any order) could then run no event loop of its own.
@pytest.fixture(scope="package")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a ready ``tokenbelt serve`` (one for the web tests that need no other)."""
    with serve_default_model(tmp_path_factory.mktemp("serve"), START_NET_S) as url:
        yield url


@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=START_NET_S * 1000
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Browser, server_url: str) -> Iterator[Page]:
    """A fresh page on the chat, with a working model; fails the test on a page error."""
    yield from open_chat_page(browser, server_url)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
