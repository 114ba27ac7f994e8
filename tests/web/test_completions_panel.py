"""The page's request panel says what editors' code completions cost the served model:
how many it served, how many a newer keystroke superseded, the tokens computed after they
went stale, and keystroke to first token (from ``/health``, as ``tokenbelt ps``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, expect

import plainhttp
from browsing import open_chat_page
from serving import serve_default_model

CHROMIUM = Path("/usr/bin/chromium")
PREFIX = "def add(a, b):\n"

pytestmark = [
    pytest.mark.model,
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]


@pytest.fixture(scope="module")
def fim_url(tmp_path_factory: pytest.TempPathFactory, fim_gguf: Path) -> Iterator[str]:
    with serve_default_model(tmp_path_factory.mktemp("serve-fim"), 60.0, model=fim_gguf) as url:
        yield url


def test_superseded_completions_show_in_the_request_panel(
    browser: Browser, fim_url: str, fim_gguf: Path
) -> None:
    # A keystroke's completion is running when the next one (same id_slot) supersedes it.
    body = {"id_slot": 0, "input_prefix": PREFIX, "n_predict": 400, "ignore_eos": True}
    with httpx.stream("POST", f"{fim_url}/infill", json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        newer = {**body, "input_prefix": PREFIX + "  ", "n_predict": 2}
        assert plainhttp.post(f"{fim_url}/infill", json=newer, timeout=30).status_code == 200
        rest = "".join(lines)  # to the superseded stream's final event
        assert '"end_reason":"superseded"' in rest.replace(" ", "")
    health = plainhttp.get(f"{fim_url}/health", timeout=30).json()
    c = health["model_status"][fim_gguf.stem]["completions"]
    assert (c["completions"], c["superseded"]) == (2, 1)
    pages = open_chat_page(browser, fim_url)
    page = next(pages)
    try:
        panel = page.get_by_test_id("completions")
        expect(panel).to_be_visible()
        row = panel.locator(f'li[data-model="{fim_gguf.stem}"]')
        expect(row.get_by_test_id("completion-counts")).to_have_text(
            f"2 served · 1 superseded · {c['stale_tokens']} stale tokens"
        )
        expect(row.get_by_test_id("completion-first-token")).to_have_text(
            re.compile(r"keystroke to first token p50 [\d.]+ ms · p95 [\d.]+ ms")
        )
    finally:
        pages.close()
