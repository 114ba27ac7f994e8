"""The user catalog: registering a local GGUF file (``tokenbelt models add``) and forgetting it.

The GGUF header is read without its arrays (``_gguf``: architecture, context length,
name, licence, file type, parameter count); the file is hashed once so later loads can be
verified. Writes hold a file lock and replace the catalog atomically, so two ``add``
calls never lose each other's entry and a crash never leaves half a file.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from .._errors import InvalidArgument, ModelError
from ..engines import parameter_size, read_header
from ._catalog import DEVICES, NAME_PATTERN, Catalog, ModelEntry, Variant, read_user_catalog_json
from ._home import Home
from ._integrity import sha256_file, write_stamp
from ._sources import PathSource


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF header says about the model (None where a key is absent)."""

    architecture: str | None
    context_length: int | None
    name: str | None
    basename: str | None
    license: str | None
    quantization: str | None
    #: the sum of the tensors' element counts (None: the file has no tensors)
    parameter_count: int | None = None

    @property
    def parameter_size(self) -> str:
        """The parameter count as Ollama writes it (``134.52M``), or ``""``."""
        return parameter_size(self.parameter_count) if self.parameter_count else ""


def _text(metadata: dict[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    return value if isinstance(value, str) else None


def read_gguf_info(path: Path) -> GGUFInfo:
    """Read the metadata of a GGUF file; ``ModelError`` if it is not one."""
    from gguf import LlamaFileType

    header = read_header(path)
    meta = header.metadata
    arch = _text(meta, "general.architecture")
    ctx = meta.get(f"{arch}.context_length") if arch else None
    file_type = meta.get("general.file_type")
    quant = None
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        try:
            quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            quant = None
    return GGUFInfo(
        architecture=arch,
        context_length=ctx if isinstance(ctx, int) and not isinstance(ctx, bool) else None,
        name=_text(meta, "general.name"),
        basename=_text(meta, "general.basename"),
        license=_text(meta, "general.license"),
        quantization=quant,
        parameter_count=header.parameter_count or None,
    )


def _write_catalog(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", "utf-8")
    os.replace(tmp, path)


def _lock(home: Home) -> filelock.BaseFileLock:
    home.data_dir.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(str(home.catalog_file) + ".lock")


def add_model(
    path: str | Path,
    alias: str,
    *,
    device: str = "cpu",
    replace: bool = False,
    force: bool = False,
    home: Home | None = None,
) -> ModelEntry:
    """Register a local GGUF file under ``alias`` in the user catalog; returns the entry.

    Reads the header, hashes the file (blocking), and refuses an alias that exists
    unless ``replace`` (and ``force`` as well for an alias that comes with tokenbelt).
    The file stays where it is and is never deleted by tokenbelt.
    """
    home = home or Home.from_env()
    check_alias(alias, device)
    check_free(alias, replace=replace, force=force, home=home)
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ModelError(f"{file} does not exist or is not a file")
    info = read_gguf_info(file)
    if info.context_length is None:
        raise ModelError(f"{file} has no {info.architecture}.context_length in its GGUF metadata")
    variant = Variant(
        id=f"{alias}-local",
        device=device,
        quantization=info.quantization,
        size=file.stat().st_size,
        sha256=sha256_file(file),
        source=PathSource(file),
    )
    entry = ModelEntry(
        alias=alias,
        family=info.basename or info.architecture or "unknown",
        license=info.license or "unknown",
        context_length=info.context_length,
        variants=(variant,),
        architecture=info.architecture,
        origin=home.catalog_file,
    )
    register(entry, replace=replace, force=force, home=home)
    write_stamp(home.stamps_dir / f"{variant.id}.json", file, variant.sha256)
    return entry


def check_alias(alias: str, device: str) -> None:
    """``InvalidArgument`` unless ``alias`` is a valid name and ``device`` a known device."""
    if not NAME_PATTERN.match(alias):
        raise InvalidArgument(f"alias {alias!r} must be letters, digits and ._:- (at most 100)")
    if device not in DEVICES:
        raise InvalidArgument(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")


def check_free(alias: str, *, replace: bool, force: bool, home: Home) -> None:
    """``ModelError`` unless ``alias`` may be (re)defined in the user catalog.

    A taken alias needs ``replace``; an alias that comes with tokenbelt needs ``force``
    too, since the user's entry would hide the shipped model.
    """
    catalog = Catalog.load(home)
    if alias not in catalog:
        return
    existing = catalog.get(alias)
    if not replace:
        raise ModelError(f"the alias {alias!r} is taken; pick another or pass --replace")
    if existing.origin != home.catalog_file and not force:
        raise ModelError(
            f"{alias!r} comes with tokenbelt: replacing it hides the shipped model until you "
            f"run `tokenbelt models rm --forget {alias}`; pass --force as well to do it"
        )


def register(entry: ModelEntry, *, replace: bool, force: bool, home: Home) -> None:
    """Write ``entry`` into the user catalog, under the catalog's lock."""
    with _lock(home):
        data = read_user_catalog_json(home.catalog_file)
        check_free(entry.alias, replace=replace, force=force, home=home)
        catalog = Catalog.load(home)
        for v in entry.variants:
            if v.id in catalog and catalog.get(v.id).alias != entry.alias:
                raise ModelError(
                    f"the variant id {v.id!r} is used by {catalog.get(v.id).alias!r}; "
                    "pick another alias"
                )
        models = [m for m in data["models"] if m.get("alias") != entry.alias]
        models.append(entry.to_json())
        data["models"] = models
        _write_catalog(home.catalog_file, data)


def forget_model(alias: str, *, home: Home | None = None) -> ModelEntry:
    """Drop ``alias`` from the user catalog (files are kept); returns the dropped entry."""
    home = home or Home.from_env()
    with _lock(home):
        data = read_user_catalog_json(home.catalog_file)
        catalog = Catalog.load(home)
        entry = catalog.get(alias)
        if entry.origin != home.catalog_file:
            raise ModelError(
                f"{entry.alias!r} comes with tokenbelt; only models added with "
                "`tokenbelt models add` can be forgotten"
            )
        data["models"] = [m for m in data["models"] if m.get("alias") != entry.alias]
        _write_catalog(home.catalog_file, data)
    return entry
