"""Where tokenbelt keeps its own files: the user catalog and the download cache.

``TOKENBELT_HOME`` puts everything under one folder (tests, portable installs);
otherwise the platform's data and cache folders are used (XDG on Linux).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

HOME_ENV = "TOKENBELT_HOME"


@dataclass(frozen=True)
class Home:
    """The folders tokenbelt writes to. Nothing is created until it is needed."""

    #: user data: the user catalog
    data_dir: Path
    #: re-creatable files: downloads, partial downloads, locks, verification stamps
    cache_dir: Path

    @classmethod
    def from_env(cls) -> Home:
        """``$TOKENBELT_HOME`` if set, else the platform's per-user folders."""
        root = os.environ.get(HOME_ENV)
        if root:
            base = Path(root).expanduser()
            return cls(data_dir=base, cache_dir=base / "cache")
        return cls(
            data_dir=Path(platformdirs.user_data_dir("tokenbelt", appauthor=False)),
            cache_dir=Path(platformdirs.user_cache_dir("tokenbelt", appauthor=False)),
        )

    @property
    def catalog_file(self) -> Path:
        """The user catalog (entries added with ``tokenbelt models add``)."""
        return self.data_dir / "catalog.json"

    @property
    def models_dir(self) -> Path:
        """Downloaded model files, one per variant id."""
        return self.cache_dir / "models"

    @property
    def stamps_dir(self) -> Path:
        """Verification stamps: a file's size, mtime and sha256 after a full hash."""
        return self.cache_dir / "stamps"
