"""The model catalog: the file shipped in the package plus the user's own catalog.

A catalog file is JSON::

    {"version": 1, "models": [
      {"alias": "smollm2-135m", "family": "smollm2", "license": "Apache-2.0",
       "context_length": 8192,
       "variants": [{"id": "smollm2-135m-instruct-q4_1-cpu", "device": "cpu",
                     "quantization": "Q4_1", "size": 98362432, "sha256": "...",
                     "source": {"type": "distribution", ...}}]}]}

Every problem is a ``CatalogError`` naming the file and the field. A user entry
with the alias of a shipped one replaces it; variant ids are unique across both.
"""

from __future__ import annotations

import difflib
import importlib.resources
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import CatalogError, UnknownModel
from ._home import Home
from ._sources import Fields, Source, parse_source

logger = logging.getLogger("tokenbelt.models")

#: devices a variant may be built for, in the order tokenbelt prefers them
DEVICES = ("cuda", "metal", "vulkan", "cpu")
#: what a model is for: chat (generation), embedding (vectors) or rerank (scores)
KINDS = ("chat", "embedding", "rerank")
#: llama.cpp's pooling types a catalog entry may name to override its GGUF's
POOLINGS = ("mean", "cls", "last", "rank")

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")
_NAME_RULE = "a name of letters, digits and ._:- (at most 100)"
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass(frozen=True)
class Variant:
    """One file of a model: built for one device, at one quantisation."""

    id: str
    device: str
    quantization: str | None
    size: int
    sha256: str
    source: Source

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "device": self.device,
            "quantization": self.quantization,
            "size": self.size,
            "sha256": self.sha256,
            "source": self.source.to_json(),
        }


@dataclass(frozen=True)
class ModelEntry:
    """A model under one alias, with its variants."""

    alias: str
    family: str
    license: str
    context_length: int
    variants: tuple[Variant, ...]
    architecture: str | None = None
    #: the catalog file this entry came from
    origin: Path | None = None
    #: what the model is for (``KINDS``)
    kind: str = "chat"
    #: the pooling its embeddings use, overriding the GGUF's ``pooling_type`` (or None)
    pooling: str | None = None
    #: the sizes its vectors may be cut to (Matryoshka training); empty: none
    matryoshka: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "alias": self.alias,
            "family": self.family,
            "license": self.license,
            "context_length": self.context_length,
        }
        if self.architecture:
            out["architecture"] = self.architecture
        if self.kind != "chat":
            out["kind"] = self.kind
        if self.pooling:
            out["pooling"] = self.pooling
        if self.matryoshka:
            out["matryoshka"] = list(self.matryoshka)
        out["variants"] = [v.to_json() for v in self.variants]
        return out


def _parse_variant(data: object, file: Path | str, where: str, base: Path | None) -> Variant:
    f = Fields(data, file, where)
    variant_id = f.need_text(
        "id", check=NAME_PATTERN.match, expected="a name of letters, digits, ._:-"
    )
    f.where = f"{where} ({variant_id})"
    device = f.need_text(
        "device", check=lambda d: d in DEVICES, expected=f"one of {', '.join(DEVICES)}"
    )
    sha256 = f.need_text("sha256", check=_SHA256.match, expected="64 hexadecimal digits")
    if "source" not in f.data:
        f.fail('missing field "source"')
    return Variant(
        id=variant_id,
        device=device,
        quantization=f.text("quantization", required=False),
        size=f.positive_int("size"),
        sha256=sha256.lower(),
        source=parse_source(f.data["source"], file, f"{f.where}.source", base),
    )


def parse_entry(data: object, file: Path | str, where: str, base: Path | None) -> ModelEntry:
    """Validate one catalog entry; raises ``CatalogError`` naming ``file`` and the field."""
    f = Fields(data, file, where)
    alias = f.need_text(
        "alias", check=NAME_PATTERN.match, expected="a name of letters, digits, ._:-"
    )
    f.where = f"{where} ({alias})"
    variants = tuple(
        _parse_variant(v, file, f"{f.where}.variants[{i}]", base)
        for i, v in enumerate(f.items("variants"))
    )
    return ModelEntry(
        alias=alias,
        family=f.need_text("family"),
        license=f.need_text("license"),
        context_length=f.positive_int("context_length"),
        variants=variants,
        architecture=f.text("architecture", required=False),
        origin=file if isinstance(file, Path) else None,
        kind=f.text("kind", required=False) or "chat",
        pooling=f.text("pooling", required=False),
        matryoshka=_matryoshka(f),
    )


def _matryoshka(f: Fields) -> tuple[int, ...]:
    """``kind``, ``pooling`` and ``matryoshka`` of an entry, checked."""
    kind = f.data.get("kind", "chat")
    if kind not in KINDS:
        f.fail(f"expected one of {', '.join(KINDS)}, got {kind!r}", "kind")
    pooling = f.data.get("pooling")
    if pooling is not None and pooling not in POOLINGS:
        f.fail(f"expected one of {', '.join(POOLINGS)}, got {pooling!r}", "pooling")
    sizes = f.data.get("matryoshka", [])
    if not isinstance(sizes, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes
    ):
        f.fail("expected a list of positive integers", "matryoshka")
    return tuple(sizes)


def read_catalog_file(path: Path) -> list[ModelEntry]:
    """Parse one catalog file; a missing, unreadable or malformed file is a ``CatalogError``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CatalogError(f"{path}: cannot read the catalog: {exc}") from exc
    return parse_catalog_text(text, path, base=path.parent)


def parse_catalog_text(text: str, file: Path | str, base: Path | None = None) -> list[ModelEntry]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CatalogError(
            f"{file}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})"
        ) from None
    top = Fields(data, file, "")
    # Entries of kind "remote" are models served elsewhere (``_remote.py`` reads them).
    entries = [
        parse_entry(e, file, f"models[{i}]", base)
        for i, e in enumerate(top.items("models", allow_empty=True))
        if not (isinstance(e, dict) and e.get("kind") == "remote")
    ]
    seen: set[str] = set()
    for entry in entries:
        if entry.alias in seen:
            raise CatalogError(f"{file}: the alias {entry.alias!r} appears twice")
        seen.add(entry.alias)
    return entries


def read_user_catalog_json(path: Path) -> dict[str, Any]:
    """The user catalog's raw JSON (validated), or an empty catalog if it does not exist."""
    if not path.exists():
        return {"version": 1, "models": []}
    read_catalog_file(path)  # validation first: never rewrite a file we cannot read
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


class Catalog:
    """Aliases and variant ids, looked up without ever guessing another model."""

    def __init__(self, entries: list[ModelEntry] | tuple[ModelEntry, ...]) -> None:
        self._entries: dict[str, ModelEntry] = {}
        self._variants: dict[str, tuple[ModelEntry, Variant]] = {}
        for entry in entries:
            if entry.alias in self._entries:
                logger.info("%s replaces the shipped model %s", entry.origin, entry.alias)
                for v in self._entries[entry.alias].variants:
                    self._variants.pop(v.id, None)
            self._entries[entry.alias] = entry
            for v in entry.variants:
                if v.id in self._variants:
                    raise CatalogError(
                        f"{entry.origin or 'catalog'}: the variant id {v.id!r} of "
                        f"{entry.alias!r} is already used by {self._variants[v.id][0].alias!r}"
                    )
                self._variants[v.id] = (entry, v)

    @classmethod
    def load(cls, home: Home | None = None) -> Catalog:
        """The shipped catalog plus ``home``'s user catalog (if it exists)."""
        home = home or Home.from_env()
        entries = shipped_entries()
        if home.catalog_file.exists():
            entries = entries + read_catalog_file(home.catalog_file)
        return cls(entries)

    def __iter__(self) -> Iterator[ModelEntry]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._variants

    def lookup(self, name: str) -> tuple[ModelEntry, Variant | None]:
        """An alias gives ``(entry, None)``; a full variant id gives ``(entry, variant)``.

        Anything else raises ``UnknownModel`` listing close matches.
        """
        if name in self._entries:
            return self._entries[name], None
        if name in self._variants:
            return self._variants[name]
        names = list(self._entries) + list(self._variants)
        # A variant id found close is suggested by its alias: every client takes an alias
        # (an Ollama name, a server's model), not every one a variant id.
        close = []
        for found in difflib.get_close_matches(name, names, n=3, cutoff=0.5):
            alias = self._variants[found][0].alias if found in self._variants else found
            if alias not in close:
                close.append(alias)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        known = ", ".join(sorted(self._entries)) or "none"
        raise UnknownModel(f"unknown model {name!r}{hint} (known aliases: {known})")

    def get(self, alias: str) -> ModelEntry:
        """The entry for an alias or a variant id."""
        return self.lookup(alias)[0]


def shipped_catalog_text() -> str:
    return importlib.resources.files("tokenbelt.models").joinpath("catalog.json").read_text("utf-8")


def shipped_entries() -> list[ModelEntry]:
    """The entries of the catalog shipped inside the package."""
    return parse_catalog_text(shipped_catalog_text(), "tokenbelt/models/catalog.json")
