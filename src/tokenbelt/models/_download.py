"""Verified, resumable, cancellable downloads over http(s), one process at a time per file.

The file grows as ``NAME.partial`` next to its destination. A later run resumes it
with an HTTP ``Range`` request (a server that ignores the range gets a clean restart).
The sha256 is computed while the bytes arrive; only a file with the right size and
sha256 is renamed (atomically) to its final name. ``NAME.lock`` (a cross-process file
lock) makes a second downloader wait, then find the finished file.

Blocking and cancellation: ``download()`` blocks the calling thread. ``cancel`` (a
``threading.Event``) is checked while waiting for the lock and after every chunk;
a cancelled download keeps its partial file and raises ``DownloadCancelled``. A
server that sends nothing for ``stall`` seconds ends the download with a
``DownloadError`` (a cancel cannot cut a read shorter than that). Ctrl-C
(``KeyboardInterrupt``) propagates at once and also keeps the partial file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import filelock

from .._errors import DownloadCancelled, DownloadError, IntegrityError
from ._integrity import HASH_CHUNK

# httpx (with its command line, a tenth of a second) is imported where a download starts.
if TYPE_CHECKING:
    import httpx

logger = logging.getLogger("tokenbelt.models.download")

#: free space kept on top of the bytes still to download
FREE_SPACE_HEADROOM = 16 * 1024 * 1024


#: ``progress(received, total)``: bytes on disk so far (resumed ones included), of ``total``
ProgressCallback = Callable[[int, "int | None"], None]
#: called once when another process (or thread) is downloading the same file
WaitCallback = Callable[[], None]


@dataclass(frozen=True)
class DownloadTimeouts:
    """``connect``: seconds to open a connection; ``stall``: longest wait for any byte."""

    connect: float = 15.0
    stall: float = 30.0


@dataclass(frozen=True)
class DownloadResult:
    path: Path
    #: False when the file was already there (another process finished it first)
    downloaded: bool
    #: bytes kept from an earlier partial download
    resumed_from: int = 0
    #: the sha256 checked on the way in (None when nothing was downloaded)
    sha256: str | None = None


def partial_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".partial")


def lock_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".lock")


def acquire_file_lock(
    dest: Path, cancel: threading.Event | None, on_wait: Callable[[], None]
) -> filelock.BaseFileLock:
    """Take ``dest``'s cross-process lock; calls ``on_wait`` once if someone else holds it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path(dest)))
    waited = False
    while True:
        if cancel is not None and cancel.is_set():
            raise DownloadCancelled(f"cancelled while waiting for another download of {dest.name}")
        try:
            lock.acquire(timeout=0 if not waited else 0.2)
            return lock
        except filelock.Timeout:
            if not waited:
                waited = True
                on_wait()


class _Transfer:
    """One download attempt loop for one destination (state shared by the steps)."""

    def __init__(
        self,
        url: str,
        dest: Path,
        size: int,
        sha256: str,
        name: str,
        progress: ProgressCallback,
        cancel: threading.Event | None,
        timeouts: DownloadTimeouts,
    ) -> None:
        self.url, self.dest, self.size, self.sha256, self.name = url, dest, size, sha256, name
        self.host = urlsplit(url).netloc
        self.partial = partial_path(dest)
        self.progress, self.cancel, self.timeouts = progress, cancel, timeouts

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def _on_disk(self) -> int:
        try:
            return self.partial.stat().st_size
        except FileNotFoundError:
            return 0

    def _discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.partial.unlink()

    def _keep_note(self) -> str:
        return f"{self._on_disk()} of {self.size} bytes are kept: pull again to resume"

    def _hash_prefix(self, offset: int) -> hashlib._Hash:
        digest = hashlib.sha256()
        if offset:
            with self.partial.open("rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    digest.update(chunk)
        return digest

    def _check_free_space(self, needed: int) -> None:
        free = shutil.disk_usage(self.dest.parent).free
        if free < needed + FREE_SPACE_HEADROOM:
            raise DownloadError(
                f"not enough free space in {self.dest.parent} for {self.name}: "
                f"{needed / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB free; free some space "
                "or set TOKENBELT_HOME to a bigger disk"
            )

    def _start(self, response: httpx.Response, offset: int) -> int | None:
        """The offset this response starts at; None to retry from scratch."""
        status = response.status_code
        if status == 416 and offset:
            logger.info("%s: the server refused the range; restarting", self.name)
            return None
        if status not in (200, 206):
            raise DownloadError(
                f"{self.url} answered HTTP {status} {response.reason_phrase}: the URL in the "
                "catalog may be wrong or the file was moved"
            )
        if status == 200:
            length = response.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) != self.size:
                self._discard()
                raise IntegrityError(
                    f"{self.url} serves {length} bytes but the catalog says {self.size}: "
                    "the file changed at the source; update the catalog entry"
                )
            if offset:
                logger.info("%s: the server ignored the range; restarting from 0", self.name)
            return 0
        first, _, total = response.headers.get("content-range", "").partition("/")
        if total.isdigit() and int(total) != self.size:
            self._discard()
            raise IntegrityError(
                f"{self.url} has {total} bytes but the catalog says {self.size}: "
                "the file changed at the source; update the catalog entry"
            )
        if not first.startswith(f"bytes {offset}-"):
            logger.info("%s: unexpected Content-Range %r; restarting", self.name, first)
            return None
        return offset

    def _receive(self, response: httpx.Response, start: int, digest: hashlib._Hash) -> int:
        received = start
        with self.partial.open("ab" if start else "wb") as f:
            for chunk in response.iter_bytes():  # as they arrive: nothing held back
                if received + len(chunk) > self.size:
                    f.close()
                    self._discard()
                    raise IntegrityError(
                        f"{self.url} sent more than the {self.size} bytes the catalog says; "
                        "the file changed at the source; update the catalog entry"
                    )
                f.write(chunk)
                digest.update(chunk)
                received += len(chunk)
                self.progress(received, self.size)
                if self._cancelled():
                    f.flush()
                    raise DownloadCancelled(
                        f"the download of {self.name} was cancelled; {received} of "
                        f"{self.size} bytes are kept: pull again to resume"
                    )
            f.flush()
            os.fsync(f.fileno())
        return received

    def _attempt(self, client: httpx.Client, offset: int) -> tuple[int, str, int] | None:
        """(bytes on disk, sha256 so far, resumed from), or None to restart."""
        digest = self._hash_prefix(offset)
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        with client.stream("GET", self.url, headers=headers) as response:
            start = self._start(response, offset)
            if start is None:
                self._discard()
                return None
            if start != offset:
                digest = hashlib.sha256()
            received = self._receive(response, start, digest)
        return received, digest.hexdigest(), start

    def run(self, client: httpx.Client) -> tuple[str, int]:
        """Fill the partial file; returns (sha256, resumed from). Raises on any failure."""
        import httpx

        for _ in range(3):
            offset = self._on_disk()
            if offset > self.size:
                self._discard()
                offset = 0
            if offset == self.size:  # finished, but not renamed (a crash at the very end)
                digest = self._hash_prefix(offset).hexdigest()
                if digest == self.sha256:
                    return digest, offset
                self._discard()
                offset = 0
            self._check_free_space(self.size - offset)
            if self._cancelled():
                raise DownloadCancelled(f"the download of {self.name} was cancelled")
            try:
                outcome = self._attempt(client, offset)
            except httpx.ConnectTimeout as exc:
                raise DownloadError(
                    f"could not connect to {self.host} within {self.timeouts.connect:g} s; "
                    "check the network and pull again"
                ) from exc
            except httpx.ConnectError as exc:
                raise DownloadError(
                    f"cannot connect to {self.host} ({exc}); check the network and pull again"
                ) from exc
            except httpx.TimeoutException as exc:
                raise DownloadError(
                    f"the download of {self.name} stalled: no data from {self.host} for "
                    f"{self.timeouts.stall:g} s; {self._keep_note()}"
                ) from exc
            except httpx.HTTPError as exc:
                raise DownloadError(
                    f"the connection to {self.host} broke ({type(exc).__name__}: {exc}); "
                    f"{self._keep_note()}"
                ) from exc
            if outcome is None:
                continue
            received, sha256, resumed = outcome
            if received < self.size:
                raise DownloadError(
                    f"{self.host} closed the connection after {received} of {self.size} bytes "
                    f"of {self.name}; {self._keep_note()}"
                )
            if sha256 != self.sha256:
                self._discard()
                raise IntegrityError(
                    f"{self.name} from {self.url} has sha256 {sha256[:16]}... but the catalog "
                    f"says {self.sha256[:16]}...; the partial file was removed; the source or "
                    "the catalog entry is wrong"
                )
            return sha256, resumed
        raise DownloadError(f"{self.url} keeps refusing to resume; the partial file was removed")


def new_client(timeouts: DownloadTimeouts) -> httpx.Client:
    import httpx

    return httpx.Client(
        timeout=httpx.Timeout(timeouts.stall, connect=timeouts.connect),
        follow_redirects=True,
        headers={"User-Agent": "tokenbelt", "Accept-Encoding": "identity"},
    )


def download(
    url: str,
    dest: Path,
    *,
    size: int,
    sha256: str,
    name: str | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    timeouts: DownloadTimeouts | None = None,
    on_wait: WaitCallback | None = None,
) -> DownloadResult:
    """Download ``url`` to ``dest`` unless it is there; verify size and sha256 first.

    Raises ``DownloadError`` (network, HTTP status, stall, disk space),
    ``IntegrityError`` (wrong size or sha256: the partial file is removed) or
    ``DownloadCancelled`` (the partial file is kept for resuming).
    """
    name = name or dest.name
    report: ProgressCallback = progress or (lambda _received, _total: None)
    timeouts = timeouts or DownloadTimeouts()
    lock = acquire_file_lock(dest, cancel, on_wait or (lambda: None))
    try:
        if dest.exists():  # finished by another process while we waited, or earlier
            return DownloadResult(dest, downloaded=False)
        transfer = _Transfer(url, dest, size, sha256, name, report, cancel, timeouts)
        with new_client(timeouts) as client:
            digest, resumed = transfer.run(client)
        os.replace(transfer.partial, dest)
        _fsync_dir(dest.parent)
        return DownloadResult(dest, downloaded=True, resumed_from=resumed, sha256=digest)
    finally:
        lock.release()


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
