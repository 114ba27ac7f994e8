"""The Hugging Face source, through ``huggingface_hub``: its cache, its locks, its resume.

``HF_ENDPOINT`` is read when a download starts (``huggingface_hub`` reads it once at
import), and ``HF_HUB_OFFLINE``/``HF_HOME`` are honoured by the library. Progress and
cancellation ride on the progress-bar class the library accepts: each ``update()``
reports the bytes and raises once ``cancel`` is set. Whether the partial file survives
a cancel is the library's choice: recent ``huggingface_hub`` releases download to a
per-process temporary file and delete it on failure, so the next pull starts over.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import socket
import threading
import urllib.parse
from pathlib import Path
from typing import Any

from .._errors import DownloadCancelled, DownloadError
from ._download import FREE_SPACE_HEADROOM, ProgressCallback
from ._sources import HuggingFaceSource


def one_line_per_hub_record() -> None:
    """Let ``huggingface_hub``'s log records reach the application's handlers only.

    The library gives its logger a bare ``StreamHandler`` of its own and lets records
    propagate too: under ``tokenbelt serve`` (or any application that configures
    logging) each of its warnings, a retry while offline, was printed twice, once
    without time or level. Without a configured handler, Python's last-resort handler
    still prints warnings.
    """
    hub = logging.getLogger("huggingface_hub")
    for handler in list(hub.handlers):
        if type(handler) is logging.StreamHandler:
            hub.removeHandler(handler)


#: a proxy reaches the Hub's host for us: its name need not resolve here
_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT``, read at each call, else huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def check_resolves() -> None:
    """``DownloadError`` at once when the Hub's host name does not resolve (offline):
    huggingface_hub retries a connection error five times, about 23 s, before it gives
    up. Not checked with ``HF_HUB_OFFLINE`` (the library answers from its cache at
    once) or through a proxy."""
    from huggingface_hub import constants

    url = endpoint()
    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in _PROXIES):
        return
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise DownloadError(
            f"the Hub at {url} cannot be reached: {parts.hostname} does not resolve "
            f"({getattr(exc, 'strerror', None) or exc}); offline, models already in the "
            "Hugging Face cache still load (HF_HUB_OFFLINE=1 skips the network)"
        ) from None


class _HubCancelled(Exception):
    """Raised from the progress bar to unwind ``hf_hub_download`` on a cancel."""


def _progress_bar_class(
    name: str, size: int, progress: ProgressCallback | None, cancel: threading.Event | None
) -> type:
    class ProgressBridge:
        """Quacks like the ``tqdm`` bar ``huggingface_hub`` drives."""

        def __init__(self, *_args: Any, initial: int = 0, **_kwargs: Any) -> None:
            self.n = initial

        def __enter__(self) -> ProgressBridge:
            return self

        def __exit__(self, *_exc: object) -> None:
            return None

        def update(self, n: int | float = 1) -> None:
            self.n += int(n)
            if progress is not None:
                progress(self.n, size)
            if cancel is not None and cancel.is_set():
                raise _HubCancelled

        def close(self) -> None:
            return None

        def refresh(self, *_args: Any, **_kwargs: Any) -> None:
            return None

        def set_description(self, *_args: Any, **_kwargs: Any) -> None:
            return None

    return ProgressBridge


def cached_path(src: HuggingFaceSource) -> Path | None:
    """The file's path in the Hugging Face cache if it is there (no network)."""
    from huggingface_hub import try_to_load_from_cache

    one_line_per_hub_record()

    found = try_to_load_from_cache(src.repo, src.file, revision=src.revision)
    if isinstance(found, str) and Path(found).exists():
        return Path(found)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def fetch(
    src: HuggingFaceSource,
    *,
    name: str,
    size: int,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """Download (or find in the cache) one repository file; returns its cached path."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if cached_path(src) is None:  # (which also keeps the hub's records to one line)
        check_resolves()
        cache_dir = Path(constants.HF_HUB_CACHE)
        probe = cache_dir if cache_dir.exists() else cache_dir.parent
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(probe).free
            if free < size + FREE_SPACE_HEADROOM:
                raise DownloadError(
                    f"not enough free space in {cache_dir} for {name}: {size / 2**20:.1f} MiB "
                    f"needed, {free / 2**20:.1f} MiB free; free some space or set HF_HOME"
                )
    if cancel is not None and cancel.is_set():
        raise DownloadCancelled(f"the download of {name} was cancelled")
    extra: dict[str, Any] = {}
    # Older huggingface_hub releases have no tqdm_class: they download without our
    # progress reports and can only be stopped by Ctrl-C.
    if "tqdm_class" in inspect.signature(hf_hub_download).parameters:
        extra["tqdm_class"] = _progress_bar_class(name, size, progress, cancel)
    try:
        found = hf_hub_download(
            src.repo,
            src.file,
            revision=src.revision,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            **extra,
        )
    except _HubCancelled:
        raise DownloadCancelled(
            f"the download of {name} was cancelled; pull again to fetch it "
            "(huggingface_hub decides whether its partial file is resumed)"
        ) from None
    except LocalEntryNotFoundError as exc:
        raise DownloadError(
            f"{src.describe()} is not in the Hugging Face cache and the Hub could not be "
            f"reached (offline, HF_HUB_OFFLINE set, or HF_ENDPOINT wrong): {_first_line(exc)}"
        ) from exc
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise DownloadError(
            f"{src.describe()} was not found on the Hub ({type(exc).__name__}); "
            "check the repo, file and revision in the catalog entry"
        ) from exc
    except Exception as exc:  # the library's network and file errors, translated here
        raise DownloadError(
            f"fetching {src.describe()} failed: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    return Path(str(found))


def remove(src: HuggingFaceSource) -> list[Path]:
    """Remove the cached file (its snapshot link and the blob it points to)."""
    link = cached_path(src)
    if link is None:
        return []
    removed: list[Path] = []
    blob = link.resolve()
    for p in (link, blob):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed
