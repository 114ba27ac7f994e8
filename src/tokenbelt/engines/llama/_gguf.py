"""A GGUF file's header, read without its arrays: the metadata keys tokenbelt shows, the
tensors' names and the parameter count (the sum of the tensors' element counts).

``gguf.GGUFReader`` decodes every metadata array, the vocabulary and merges among them,
into Python objects: seconds for a small model, before any answer that reads a header
(Ollama's ``/api/tags`` on a fresh server, the classification-head check of a
reranker's load). Here a scalar is read where it lies and an
array is stepped over; the tensors' shapes come after the metadata. The format is
llama.cpp's ``docs/gguf.md`` (versions 2 and 3, little-endian).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._errors import ModelError

# value types -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


#: bytes per element of each KV cache type (q8_0: 32 values in 34 bytes)
KV_ELEMENT_BYTES = {"f16": 2.0, "q8_0": 34 / 32}


@dataclass
class GGUFHeader:
    """The scalar and string metadata of a GGUF file, its tensors' names and its
    parameter count; where each metadata entry lies, and where the tensor infos end
    (the tensor data starts at the next multiple of ``general.alignment``, 32 if unset)."""

    metadata: dict[str, Any] = field(default_factory=dict)
    tensor_names: list[str] = field(default_factory=list)
    parameter_count: int = 0
    #: key -> (offset of the entry, offset just past its value), arrays included
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: the offset just past the last tensor info
    infos_end: int = 0

    @property
    def context_length(self) -> int | None:
        """The context the model was trained on, as the file says (None: not said)."""
        arch = self.metadata.get("general.architecture", "llama")
        value = self.metadata.get(f"{arch}.context_length")
        return int(value) if isinstance(value, int) else None

    def kv_cell_bytes(self, kv_type: str = "f16") -> float:
        """Bytes one token takes in the KV cache: ``layers * kv_heads * (key + value
        length)`` elements of ``kv_type`` (``KV_ELEMENT_BYTES``)."""
        meta = self.metadata
        arch = meta.get("general.architecture", "llama")

        def field(name: str, default: int = 0) -> int:
            value = meta.get(f"{arch}.{name}", default)
            return int(value) if isinstance(value, int | float) else default

        layers, heads = field("block_count"), max(1, field("attention.head_count", 1))
        kv_heads = field("attention.head_count_kv", heads) or heads
        per_head = field("embedding_length") // heads
        key = field("attention.key_length", per_head)
        value = field("attention.value_length", per_head)
        return layers * kv_heads * (key + value) * KV_ELEMENT_BYTES.get(kv_type, 2.0)


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.data[self.at : self.at + n]
        if len(raw) != n:
            raise ValueError("a string runs past the end of the file")
        self.at += n
        return bytes(raw).decode("utf-8", "replace")

    def skip_strings(self, count: int = 1) -> None:
        """Step over ``count`` strings (a vocabulary holds tens of thousands, so the loop
        keeps to locals: a method call per string made a header read 60 ms, not 40)."""
        data, at, length = self.data, self.at, _U64.unpack_from
        for _ in range(count):
            at += 8 + length(data, at)[0]
        self.at = at

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.unpack("<I"), self.unpack("<Q")
            if inner == _STRING:
                self.skip_strings(count)
            elif inner in _SCALARS:
                self.at += struct.calcsize(_SCALARS[inner]) * count
            else:
                for _ in range(count):
                    self.value(inner)
            return None  # arrays are stepped over
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata type {kind}")
        return self.unpack(_SCALARS[kind])


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file ``path``; ``ModelError`` if it cannot be read as one."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(data, path)
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _parse(data: mmap.mmap, path: Path) -> GGUFHeader:
    cursor = _Cursor(data)
    try:
        if bytes(data[:4]) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF model file (it does not start with 'GGUF')")
        cursor.at = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ModelError(f"{path} is GGUF version {version}; tokenbelt reads versions 2 and 3")
        tensors, keys = cursor.unpack("<Q"), cursor.unpack("<Q")
        header = GGUFHeader()
        for _ in range(keys):
            start = cursor.at
            key = cursor.string()
            value = cursor.value(cursor.unpack("<I"))
            header.spans[key] = (start, cursor.at)
            if value is not None:
                header.metadata[key] = value
        for _ in range(tensors):
            header.tensor_names.append(cursor.string())
            dims = cursor.unpack("<I")
            count = 1
            for _ in range(dims):
                count *= cursor.unpack("<Q")
            cursor.at += 4 + 8  # the tensor's type and offset
            header.parameter_count += count
        header.infos_end = cursor.at
    except (struct.error, ValueError, IndexError) as exc:
        raise ModelError(f"{path} has a damaged GGUF header: {exc}") from exc
    return header


def parameter_size(count: int) -> str:
    """A parameter count as Ollama writes it: ``134.52M``, ``7.24B``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(count)
