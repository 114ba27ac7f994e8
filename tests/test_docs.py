"""The documentation site builds with ``mkdocs build --strict``, and the README's links hold.

``mkdocs.yml`` makes a broken link or anchor, a page left out of the nav and a docstring
cross-reference that resolves to nothing into warnings; ``--strict`` fails the build on
any of them. The API reference is read from ``src/`` by griffe, without importing
tokenbelt, so the build needs no model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# [text](target): the README's relative links, which GitHub resolves against the tree
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_site_builds_strictly_with_no_warning(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT,
        # Material's banner about its successor is not a warning of this build
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=110,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "WARNING" not in log, log
    assert (site / "index.html").is_file()
    # the reference was generated from the docstrings, not left as its ::: directives
    runtime = (site / "reference" / "tokenbelt" / "index.html").read_text("utf-8")
    assert 'id="tokenbelt.Runtime"' in runtime
    assert ":::" not in runtime
    # the README's sections are included where getting-started.md asks for them
    start = (site / "getting-started" / "index.html").read_text("utf-8")
    assert "scripts/serve" in start
    assert "BatchEngine._step_once" in start


def test_every_docs_page_is_in_the_nav() -> None:
    # mkdocs warns about an omitted page too; this names it without a build
    nav = (ROOT / "mkdocs.yml").read_text("utf-8")
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    missing = [page for page in pages if f" {page}" not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_the_readme_links_point_at_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text("utf-8")
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_the_readme_stays_short() -> None:
    # the README is the front door; the manual is the site
    lines = (ROOT / "README.md").read_text("utf-8").count("\n")
    assert lines < 150, f"README.md has {lines} lines; move the detail to a page under docs/"


def test_where_to_look_first_names_real_places() -> None:
    # Each row's files exist, and each ``Class.method`` or name it gives is defined in one
    # of the row's files: a rename or a move that leaves the map behind fails here.
    text = (ROOT / "README.md").read_text("utf-8")
    table = text.split("[start:where-to-look]")[1].split("[end:where-to-look]")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) >= 8
    missing = []
    for row in rows:
        spans = re.findall(r"`([^`]+)`", row)
        files = [ROOT / s for s in spans if s.startswith("src/")]
        assert files, f"a row names no file under src/: {row}"
        for path in files:
            if not path.exists():
                missing.append(str(path.relative_to(ROOT)))
        sources = "\n".join(p.read_text("utf-8") for p in files if p.is_file())
        for span in spans:
            if span.startswith("src/") or span.endswith("/") or "(" in span or " " in span:
                continue
            for part in span.split("."):
                if not re.search(rf"\b(class|def) {re.escape(part)}\b", sources):
                    missing.append(f"{span} (in {row.split('|')[1].strip()})")
    assert not missing, f"README.md's where-to-look table names what is not there: {missing}"
