"""Size and sha256 checks, with a stamp that skips re-hashing an unchanged file.

A stamp records a file's path, size, mtime and sha256 right after a full hash. While
all of them still match, the file is taken as verified without reading it again;
``force=True`` (``tokenbelt models verify``) always reads the whole file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from .._errors import DownloadCancelled, IntegrityError

logger = logging.getLogger("tokenbelt.models")

HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Stamp:
    path: str
    size: int
    mtime_ns: int
    sha256: str


def sha256_file(path: Path, *, cancel: threading.Event | None = None) -> str:
    """Hash a whole file; blocks for as long as reading it takes, checks ``cancel`` per MiB."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled(f"verifying {path} was cancelled")
            digest.update(chunk)
    return digest.hexdigest()


def _read_stamp(stamp_file: Path) -> Stamp | None:
    try:
        return Stamp(**json.loads(stamp_file.read_text("utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def stamp_matches(path: Path, sha256: str, stamp_file: Path) -> bool:
    """True if ``stamp_file`` vouches for ``path`` as it is now (no hashing)."""
    try:
        st = path.stat()
    except OSError:
        return False
    stamp = _read_stamp(stamp_file)
    return stamp == Stamp(str(path.resolve()), st.st_size, st.st_mtime_ns, sha256)


def write_stamp(stamp_file: Path, path: Path, sha256: str) -> None:
    """Record that ``path`` (as it is now) has ``sha256``. Best effort: a failure is logged."""
    try:
        st = path.stat()
        stamp = Stamp(str(path.resolve()), st.st_size, st.st_mtime_ns, sha256)
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp_file.with_name(f"{stamp_file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(asdict(stamp)), "utf-8")
        os.replace(tmp, stamp_file)
    except OSError as exc:
        logger.warning("could not write the verification stamp %s: %s", stamp_file, exc)


def remove_stamp(stamp_file: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        stamp_file.unlink()


def verify_file(
    path: Path,
    *,
    size: int,
    sha256: str,
    stamp_file: Path | None,
    fix: str,
    force: bool = False,
    cancel: threading.Event | None = None,
) -> bool:
    """Raise ``IntegrityError`` unless ``path`` has ``size`` bytes and ``sha256``.

    Returns True if the file was hashed now, False if a matching stamp vouched for
    it. ``fix`` ends the error message: what the user should do about it.
    """
    try:
        st = path.stat()
    except OSError as exc:
        raise IntegrityError(f"{path} cannot be read ({exc.strerror}); {fix}") from exc
    if st.st_size != size:
        if stamp_file is not None:
            remove_stamp(stamp_file)
        raise IntegrityError(
            f"{path} has {st.st_size} bytes but should have {size}: "
            f"it is truncated or corrupt; {fix}"
        )
    if not force and stamp_file is not None and stamp_matches(path, sha256, stamp_file):
        return False
    actual = sha256_file(path, cancel=cancel)
    if actual != sha256:
        if stamp_file is not None:
            remove_stamp(stamp_file)
        raise IntegrityError(
            f"{path} has sha256 {actual[:16]}... but should have {sha256[:16]}...: "
            f"the file is corrupt; {fix}"
        )
    if stamp_file is not None:
        write_stamp(stamp_file, path, sha256)
    return True
