"""Where each variant's file lives on this machine, fetching it, verifying it, removing it.

- ``distribution``: the file inside the installed package (never copied or removed);
- ``path``: the user's own file (never copied or removed);
- ``url``: ``<cache>/models/<variant id>.gguf``, downloaded by ``_download``;
- ``huggingface``: the Hugging Face cache, through ``huggingface_hub``.

Whatever the source, a file is verified (size, sha256) before anyone loads it; a stamp
in ``<cache>/stamps`` lets an unchanged file skip the hash next time.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from .._errors import IntegrityError, ModelError, UnknownModel
from . import _hf
from ._catalog import Variant
from ._download import (
    DownloadTimeouts,
    ProgressCallback,
    WaitCallback,
    acquire_file_lock,
    download,
    partial_path,
)
from ._embedded import distribution_file
from ._home import Home
from ._integrity import remove_stamp, stamp_matches, verify_file, write_stamp
from ._sources import DistributionSource, HuggingFaceSource, PathSource, UrlSource


class ModelCache:
    """The files of catalog variants on this machine (one ``Home``)."""

    def __init__(self, home: Home | None = None) -> None:
        self.home = home or Home.from_env()

    def download_path(self, variant: Variant) -> Path:
        return self.home.models_dir / f"{variant.id}.gguf"

    def stamp_path(self, variant: Variant) -> Path:
        return self.home.stamps_dir / f"{variant.id}.json"

    def local_path(self, variant: Variant) -> Path | None:
        """The variant's file if it is on this machine now; no network, no hashing."""
        src = variant.source
        if isinstance(src, DistributionSource):
            try:
                return distribution_file(src.distribution, src.file)
            except UnknownModel:
                return None
        if isinstance(src, PathSource):
            found = src.path
        elif isinstance(src, UrlSource):
            found = self.download_path(variant)
        else:
            return _hf.cached_path(src)
        return found if found.exists() else None

    def is_cached(self, variant: Variant) -> bool:
        return self.local_path(variant) is not None

    def partial_size(self, variant: Variant) -> int:
        """Bytes of an interrupted download waiting to be resumed (url sources)."""
        if not isinstance(variant.source, UrlSource):
            return 0
        try:
            return partial_path(self.download_path(variant)).stat().st_size
        except FileNotFoundError:
            return 0

    def corrupt_path(self, variant: Variant) -> Path:
        """Where the last failed verification of the variant's file is recorded."""
        return self.home.stamps_dir / f"{variant.id}.corrupt.json"

    def state(self, variant: Variant) -> str:
        """A cheap status for listings, from the last verification: ``verified`` (its
        stamp matches), ``corrupt`` (the last check failed and the file has not changed
        since), ``unverified`` (on disk, not checked yet), ``partial NN%`` (an
        interrupted download) or ``absent``."""
        path = self.local_path(variant)
        if path is not None:
            if stamp_matches(path, variant.sha256, self.stamp_path(variant)):
                return "verified"
            if stamp_matches(path, variant.sha256, self.corrupt_path(variant)):
                return "corrupt"
            return "unverified"
        partial = self.partial_size(variant)
        if partial:
            return f"partial {100 * partial // variant.size}%"
        return "absent"

    def fix_hint(self, variant: Variant) -> str:
        """What to do about a bad file, for error messages."""
        src = variant.source
        if isinstance(src, DistributionSource):
            return f"reinstall its package: pip install --force-reinstall {src.distribution}"
        if isinstance(src, PathSource):
            return (
                "the local file changed since it was added: register it again with "
                "`tokenbelt models add PATH --alias NAME --replace`"
            )
        return f"remove it with `tokenbelt models rm {variant.id}` and pull again"

    def fetch(
        self,
        variant: Variant,
        *,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
        timeouts: DownloadTimeouts | None = None,
        on_wait: WaitCallback | None = None,
    ) -> Path:
        """Make the variant's file local, downloading it if needed; does not verify it.

        Blocks while downloading; see ``_download.download`` for cancellation.
        """
        src = variant.source
        if isinstance(src, DistributionSource):
            return distribution_file(src.distribution, src.file)
        if isinstance(src, PathSource):
            if not src.path.is_file():
                raise ModelError(
                    f"{src.path} (registered for {variant.id}) does not exist; put the file "
                    f"back or forget it with `tokenbelt models rm --forget {variant.id}`"
                )
            return src.path
        if isinstance(src, HuggingFaceSource):
            return _hf.fetch(
                src, name=variant.id, size=variant.size, progress=progress, cancel=cancel
            )
        dest = self.download_path(variant)
        if dest.exists():
            return dest
        result = download(
            src.url,
            dest,
            size=variant.size,
            sha256=variant.sha256,
            name=variant.id,
            progress=progress,
            cancel=cancel,
            timeouts=timeouts,
            on_wait=on_wait,
        )
        if result.sha256 is not None:
            write_stamp(self.stamp_path(variant), dest, result.sha256)
        return result.path

    def verify(
        self,
        variant: Variant,
        path: Path,
        *,
        force: bool = False,
        cancel: threading.Event | None = None,
    ) -> bool:
        """Raise ``IntegrityError`` unless ``path`` is the variant's exact file.

        Returns True if it was hashed now, False if its stamp vouched for it.
        """
        try:
            hashed = verify_file(
                path,
                size=variant.size,
                sha256=variant.sha256,
                stamp_file=self.stamp_path(variant),
                fix=self.fix_hint(variant),
                force=force,
                cancel=cancel,
            )
        except IntegrityError:
            # Remembered (for this exact file: path, size, mtime) so that listings say
            # "corrupt" rather than "unverified" until the file changes.
            write_stamp(self.corrupt_path(variant), path, variant.sha256)
            raise
        remove_stamp(self.corrupt_path(variant))
        return hashed

    def remove(self, variant: Variant) -> list[Path]:
        """Delete what tokenbelt downloaded for ``variant`` (file, partial, stamp).

        Files from a package or a local path are never deleted. Waits for a download of
        the same file in another process to finish first.
        """
        removed: list[Path] = []
        src = variant.source
        if isinstance(src, UrlSource):
            dest = self.download_path(variant)
            lock = acquire_file_lock(dest, None, lambda: None)
            try:
                for p in (dest, partial_path(dest)):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                        removed.append(p)
            finally:
                lock.release()
        elif isinstance(src, HuggingFaceSource):
            removed = _hf.remove(src)
        remove_stamp(self.stamp_path(variant))
        remove_stamp(self.corrupt_path(variant))
        return removed
