"""The web page's microphone on a real ``tokenbelt serve`` (a chat model and
``whisper-tiny-en``) in a real Chromium whose microphone is a WAV file of espeak-ng
speech (``--use-file-for-fake-audio-capture``): the recording's words stream into the
message box, and the Stop pressed while it transcribes cancels it on the server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

import plainhttp
import speech
from serving import serve
from tokenbelt.models import default_model_path

from .conftest import CHROMIUM, CHROMIUM_ARGS, START_NET_S

pytestmark = [pytest.mark.browser, pytest.mark.model]


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return speech.speak(speech.SHORT, tmp_path_factory.mktemp("speech") / "mic.wav")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("serve")
    with serve(tmp, str(default_model_path()), "whisper-tiny-en", timeout=START_NET_S) as (
        base,
        _,
    ):
        yield base


@pytest.fixture(scope="module")
def mic_browser(clip: Path) -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    fake = [
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={clip}",
    ]
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS + fake, timeout=START_NET_S * 1000
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(mic_browser: Browser, url: str) -> Iterator[Page]:
    context = mic_browser.new_context()
    context.set_default_timeout(60_000)
    context.grant_permissions(["microphone"], origin=url)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(url + "/")
        page.wait_for_selector("[data-testid=mic]:not([hidden])")
        yield page
        assert not errors, f"the page raised: {errors}"
    finally:
        context.close()


def _record(page: Page, seconds: float) -> None:
    mic = page.get_by_test_id("mic")
    mic.click()
    page.wait_for_selector("[data-testid=mic][data-state=recording]")
    page.wait_for_timeout(seconds * 1000)
    mic.click()  # Done


def test_spoken_words_stream_into_the_message_box(page: Page) -> None:
    _record(page, 4.5)
    page.wait_for_selector("[data-testid=mic][data-state=idle]")
    text = page.get_by_test_id("prompt").input_value()
    assert speech.word_match(text, speech.SHORT) >= speech.WORD_MATCH, text


def test_stop_while_transcribing_cancels_it_on_the_server(page: Page, url: str) -> None:
    _record(page, 12)
    page.wait_for_selector("[data-testid=mic][data-state=transcribing]")
    page.get_by_test_id("mic").click()  # Stop
    page.wait_for_selector("[data-testid=mic][data-state=idle]")
    deadline = time.monotonic() + START_NET_S
    while True:
        data = plainhttp.get(f"{url}/v1/requests", timeout=30).json()["data"]
        ours = [r for r in data if r["request_id"].startswith("mic-") and r["end_reason"]]
        if ours or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ours, json.dumps(data)[:500]
    assert ours[0]["end_reason"] == "user_cancel", ours[0]
    assert ours[0]["kind"] == "transcribe"
