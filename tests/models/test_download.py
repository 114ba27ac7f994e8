"""Downloads against a real local HTTP server: resume, restart, integrity, errors, cancel."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tokenbelt import DownloadCancelled, DownloadError, IntegrityError
from tokenbelt.models import DownloadTimeouts, download
from tokenbelt.models._download import lock_path, partial_path

from .conftest import payload
from .fileserver import FileServer, Served

FAST = DownloadTimeouts(connect=2.0, stall=0.5)


def fetch(server: FileServer, dest: Path, served: Served, **kwargs: object) -> object:
    return download(
        server.url("/m.gguf"),
        dest,
        size=len(served.data),
        sha256=served.sha256,
        timeouts=kwargs.pop("timeouts", FAST),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def test_full_download_verifies_and_renames(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    dest = tmp_path / "m.gguf"
    seen: list[tuple[int, int | None]] = []
    result = download(
        server.url("/m.gguf"),
        dest,
        size=len(served.data),
        sha256=served.sha256,
        progress=lambda received, total: seen.append((received, total)),
    )
    assert result.downloaded
    assert result.resumed_from == 0
    assert result.sha256 == served.sha256
    assert dest.read_bytes() == served.data
    assert not partial_path(dest).exists()
    assert seen[-1] == (len(served.data), len(served.data))
    assert [received for received, _ in seen] == sorted(received for received, _ in seen)
    assert [(h.method, h.range, h.status) for h in server.gets] == [("GET", None, 200)]
    # a second call finds the file and makes no request
    again = fetch(server, dest, served)
    assert not again.downloaded  # type: ignore[attr-defined]
    assert len(server.gets) == 1


def test_interrupted_transfer_resumes_with_range(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload(), drop_at=200_000)
    dest = tmp_path / "m.gguf"
    with pytest.raises(DownloadError, match=r"closed the connection|broke") as info:
        fetch(server, dest, served)
    kept = partial_path(dest).stat().st_size
    assert kept == 200_000, "every byte received before the drop is kept"
    assert "resume" in str(info.value)
    assert not dest.exists()

    result = fetch(server, dest, served)
    assert result.resumed_from == 200_000  # type: ignore[attr-defined]
    assert dest.read_bytes() == served.data
    first, second = server.gets
    assert first.range is None
    assert first.sent == 200_000
    assert second.range == "bytes=200000-"
    assert second.status == 206
    assert second.sent == len(served.data) - 200_000, "the first part is not fetched again"


def test_server_without_range_support_restarts_cleanly(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload(), ranges=False, drop_at=150_000)
    dest = tmp_path / "m.gguf"
    with pytest.raises(DownloadError):
        fetch(server, dest, served)
    assert partial_path(dest).stat().st_size == 150_000

    result = fetch(server, dest, served)
    assert result.resumed_from == 0  # type: ignore[attr-defined]
    assert dest.read_bytes() == served.data
    second = server.gets[1]
    assert second.range == "bytes=150000-"
    assert second.status == 200
    assert second.sent == len(served.data)


def test_wrong_sha256_is_rejected_and_partial_removed(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    dest = tmp_path / "m.gguf"
    with pytest.raises(IntegrityError, match="sha256") as info:
        download(server.url("/m.gguf"), dest, size=len(served.data), sha256="0" * 64)
    assert "partial file was removed" in str(info.value)
    assert not dest.exists()
    assert not partial_path(dest).exists()


def test_wrong_size_is_rejected_before_downloading(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    dest = tmp_path / "m.gguf"
    with pytest.raises(IntegrityError, match="catalog says"):
        download(server.url("/m.gguf"), dest, size=len(served.data) + 1, sha256=served.sha256)
    assert not dest.exists()
    assert not partial_path(dest).exists()


def test_http_404_is_a_clear_error(server: FileServer, tmp_path: Path) -> None:
    dest = tmp_path / "m.gguf"
    with pytest.raises(DownloadError, match="HTTP 404"):
        download(server.url("/missing.gguf"), dest, size=10, sha256="0" * 64, timeouts=FAST)
    assert not dest.exists()
    assert not partial_path(dest).exists()


def test_server_that_never_answers_times_out(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload(), stall_headers=True)
    start = time.monotonic()
    with pytest.raises(DownloadError, match=r"stalled: no data .* for 0.5 s"):
        fetch(server, tmp_path / "m.gguf", served)
    assert time.monotonic() - start < 10
    assert server.stalled.is_set()


def test_server_stalling_mid_body_times_out_and_keeps_partial(
    server: FileServer, tmp_path: Path
) -> None:
    served = server.files["/m.gguf"] = Served(payload(), stall_at=300_000)
    dest = tmp_path / "m.gguf"
    with pytest.raises(DownloadError, match="stalled") as info:
        fetch(server, dest, served)
    assert partial_path(dest).stat().st_size == 300_000
    assert "300000 of" in str(info.value)
    server.release.set()
    fetch(server, dest, served)
    assert dest.read_bytes() == served.data
    assert server.gets[-1].range == "bytes=300000-"


def test_unreachable_host_is_a_clear_error(tmp_path: Path) -> None:
    with FileServer() as gone:
        url = gone.url("/m.gguf")
    with pytest.raises(DownloadError, match=r"cannot connect|could not connect"):
        download(url, tmp_path / "m.gguf", size=10, sha256="0" * 64, timeouts=FAST)


def test_cancel_mid_download_keeps_a_resumable_partial(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    dest = tmp_path / "m.gguf"
    cancel = threading.Event()

    def progress(received: int, total: int | None) -> None:
        if received >= 100_000:
            cancel.set()

    with pytest.raises(DownloadCancelled, match="resume"):
        fetch(server, dest, served, progress=progress, cancel=cancel)
    kept = partial_path(dest).stat().st_size
    assert 100_000 <= kept < len(served.data)
    assert not dest.exists()
    # the lock is free again: the resume does not wait
    result = fetch(server, dest, served)
    assert result.resumed_from == kept  # type: ignore[attr-defined]
    assert dest.read_bytes() == served.data
    assert server.gets[-1].range == f"bytes={kept}-"


def test_cancel_before_start_downloads_nothing(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(DownloadCancelled):
        fetch(server, tmp_path / "m.gguf", served, cancel=cancel)
    assert server.gets == []


def test_not_enough_free_space_fails_before_any_request(server: FileServer, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="not enough free space"):
        download(server.url("/m.gguf"), tmp_path / "m.gguf", size=10**18, sha256="0" * 64)
    assert server.hits == []


def test_oversized_partial_is_discarded(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    dest = tmp_path / "m.gguf"
    partial_path(dest).write_bytes(b"x" * (len(served.data) + 10))
    fetch(server, dest, served)
    assert dest.read_bytes() == served.data
    assert server.gets[0].range is None


def test_complete_partial_is_renamed_without_a_request(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    dest = tmp_path / "m.gguf"
    partial_path(dest).write_bytes(served.data)
    result = fetch(server, dest, served)
    assert result.downloaded  # type: ignore[attr-defined]
    assert dest.read_bytes() == served.data
    assert server.hits == []


def test_complete_but_wrong_partial_is_downloaded_again(server: FileServer, tmp_path: Path) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    dest = tmp_path / "m.gguf"
    partial_path(dest).write_bytes(bytes(len(served.data)))
    fetch(server, dest, served)
    assert dest.read_bytes() == served.data
    assert [h.range for h in server.gets] == [None]


def test_foreign_partial_is_caught_by_the_hash(server: FileServer, tmp_path: Path) -> None:
    """A partial file that is not a prefix of the real file fails the sha256, never loads."""
    served = server.files["/m.gguf"] = Served(payload())
    dest = tmp_path / "m.gguf"
    partial_path(dest).write_bytes(b"\0" * 1000)
    with pytest.raises(IntegrityError):
        fetch(server, dest, served)
    assert not dest.exists()
    assert not partial_path(dest).exists()
    fetch(server, dest, served)
    assert dest.read_bytes() == served.data


def test_two_threads_pull_one_file_once(server: FileServer, tmp_path: Path) -> None:
    gate = threading.Event()
    served = server.files["/m.gguf"] = Served(payload(), gate=gate)
    dest = tmp_path / "m.gguf"
    second_waits = threading.Event()
    results: dict[str, object] = {}

    def pull(name: str, on_wait: object = None) -> None:
        results[name] = fetch(server, dest, served, on_wait=on_wait)

    first = threading.Thread(target=pull, args=("first",))
    first.start()
    assert server.requested.wait(10), "the first pull reached the server"
    second = threading.Thread(target=pull, args=("second", second_waits.set))
    second.start()
    try:
        assert second_waits.wait(10), "the second pull waits for the first"
    finally:
        gate.set()
        first.join(10)
        second.join(10)
    assert results["first"].downloaded  # type: ignore[attr-defined]
    assert not results["second"].downloaded  # type: ignore[attr-defined]
    assert len(server.gets) == 1, "one GET of the body"
    assert dest.read_bytes() == served.data
    assert lock_path(dest).exists()
