"""Every ```python block of the README and of the pages under docs/ runs.

The convention (docs/contributing.md has it for writers):

- a page's blocks run in order in one namespace, which starts with ``tokenbelt`` and
  ``model`` (the embedded default model, loaded once for this file);
- ``<!-- run with a server -->`` right before a block: it runs with a real ``tokenbelt
  serve`` of the default model, its ``http://127.0.0.1:8080`` read as that server's address;
- ``<!-- not run: REASON -->`` right before a block: it is not run, and REASON is required.

Shell blocks are not run. A failing example's traceback names its page and line.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import tokenbelt
from serving import serve

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON = {"python", "py", "python3", "pycon"}
#: the address the examples use, as ``scripts/serve`` serves it
EXAMPLE_URL = "http://127.0.0.1:8080"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<text>.*?)\s*-->\s*$")
_NOT_RUN = re.compile(r"^not run\b:?\s*(?P<reason>.*)$")
_SERVER = "run with a server"


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # the fence's line, 1-based
    source: str  # padded with blank lines, so its line numbers are the page's
    mode: str  # "run", "server" or "skip"
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples(page: Path) -> list[Example]:
    """The ```python blocks of a page, with what the comment before each asks."""
    lines = page.read_text("utf-8").splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence = opening["fence"]
        end = i + 1
        while end < len(lines):
            closing = lines[end].strip()
            if closing.startswith(fence) and set(closing) == {fence[0]}:
                break
            end += 1
        language = (opening["info"].split() or [""])[0].lower()
        if language in PYTHON:
            body = textwrap.dedent("\n".join(lines[i + 1 : end]))
            source = "\n" * (i + 1) + body + "\n"
            found.append(Example(page, i + 1, source, *_mode(lines, i)))
        i = end + 1
    return found


def _mode(lines: list[str], fence: int) -> tuple[str, str]:
    before = fence - 1
    while before >= 0 and not lines[before].strip():
        before -= 1
    comment = _COMMENT.match(lines[before]) if before >= 0 else None
    if comment is None:
        return "run", ""
    text = comment["text"]
    not_run = _NOT_RUN.match(text)
    if not_run is not None:
        return "skip", not_run["reason"].strip()
    if text == _SERVER:
        return "server", ""
    return "run", ""


ALL = [example for page in PAGES for example in examples(page)]
WITH_EXAMPLES = sorted({example.page for example in ALL if example.mode != "skip"})


def test_the_pages_have_examples_to_run() -> None:
    # the collection itself: a change to the fence parsing that finds nothing fails here
    assert len([e for e in ALL if e.mode == "run"]) >= 4
    assert any(e.mode == "server" for e in ALL)
    assert ROOT / "README.md" in WITH_EXAMPLES


def test_every_example_not_run_says_why() -> None:
    silent = [str(e) for e in ALL if e.mode == "skip" and len(e.reason) < 10]
    assert not silent, f"<!-- not run: REASON --> needs its reason: {silent}"


@pytest.fixture(scope="module")
def model() -> Iterator[tokenbelt.Model]:
    with tokenbelt.Runtime(keep_alive=None) as rt:
        yield rt.load(tokenbelt.DEFAULT_ALIAS, load_timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # in the server's process: the examples show the API, not the worker boundary
    flags = ("--isolation", "thread", "--slots", "2")
    with serve(tmp_path_factory.mktemp("docs-serve"), tokenbelt.DEFAULT_ALIAS, flags=flags) as (
        url,
        _,
    ):
        yield url


@pytest.mark.model
@pytest.mark.parametrize(
    "page", WITH_EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in WITH_EXAMPLES]
)
def test_the_examples_of_a_page_run(
    page: Path, model: tokenbelt.Model, request: pytest.FixtureRequest
) -> None:
    namespace: dict[str, object] = {
        "__name__": "docs_example",
        "tokenbelt": tokenbelt,
        "model": model,
    }
    for example in examples(page):
        if example.mode == "skip":
            continue
        source = example.source
        if example.mode == "server":
            url = request.getfixturevalue("server")
            assert EXAMPLE_URL in source, f"{example}: a server example names {EXAMPLE_URL}"
            source = source.replace(EXAMPLE_URL, url)
        exec(compile(source, str(page), "exec"), namespace)
