"""The probe's failure paths: every failing step is named, with what to do."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenbelt.models import Home, default_model_path, run_probe

from .conftest import CPU_ONLY, catalog_of, payload, url_entry
from .fileserver import FileServer, Served


def test_a_corrupt_model_is_refused_before_load(tmp_path: Path, home: Home) -> None:
    good = default_model_path()
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(good, copy)
    e = url_entry("copy", "https://unused", Served(b"unused"))
    e["variants"][0].update(
        size=good.stat().st_size,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source={"type": "path", "path": str(copy)},
    )
    with copy.open("r+b") as f:  # bytes flipped in the middle: the GGUF header is intact
        f.seek(copy.stat().st_size // 2)
        f.write(b"\xff" * 16)
    report = run_probe("copy", catalog=catalog_of(e), info=CPU_ONLY)
    assert not report.ok
    assert report.failed_step == "verify"
    assert report.error is not None
    assert "sha256" in report.error
    assert str(copy) in report.error
    assert report.hint is not None
    assert "register it again" in report.hint
    assert report.verified is False
    assert report.load_s is None, "never loaded"
    assert "load" not in report.steps_ms


def test_a_failed_download_fails_the_resolve_step(home: Home) -> None:
    with FileServer() as gone:  # a port nobody listens on any more
        url = gone.url("/m.gguf")
    catalog = catalog_of(url_entry("m", url, Served(payload())))
    report = run_probe("m", catalog=catalog, info=CPU_ONLY)
    assert not report.ok
    assert report.failed_step == "resolve"
    assert report.error is not None
    assert "connect" in report.error
    assert report.hint == "check the network, then `tokenbelt models pull ALIAS`"
