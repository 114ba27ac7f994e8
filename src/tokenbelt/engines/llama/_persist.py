"""Prefix caches that survive an unload: a batch engine's cache entries on disk.

At ``close()`` a batch engine given a ``prefix_cache_dir`` writes its prefix-cache
entries there (``PrefixStore.save``), most recently used first, while they fit in the
disk budget. At its next load of the same model with the same KV settings it reads
them back into free sequences (``PrefixStore.restore``) on the loop's thread, after
the warm-up and before the loop takes a request, so the next turn of a long
conversation copies those cells (``trace.cached_tokens``) instead of computing its
prompt again. Reading a sequence's cells back costs a file read; computing them costs
a prefill.

Layout: ``<dir>/<model stem>-<key digest>/`` holds ``key.json`` (the key, in full)
and one ``<rank>.kv`` per entry, rank 0 the most recently used. An entry file is a
header (magic ``TBKV``, format, the key's sha256, token count, state size, crc32 of
the rest), the tokens (int32), then llama.cpp's sequence state
(``llama_state_seq_get_data``). Every file is written under a temporary name and
renamed, so a reader sees a whole file or none.

The key is what the cells depend on: the model file (its resolved path, size,
``mtime_ns``, inode, and the sha256 of its first and last MiB: hashing a whole
multi-GiB file at each load would cost more than the prefill it saves), the model's
``n_embd`` and ``n_layer``, the KV element type, llama-cpp-python's version (which
pins its llama.cpp) and llama.cpp's sequence-state format. Invalidation:

- another key is another directory, never read into this context;
- at load, a set of the same model path under another key is stale (the file
  changed, or the KV settings did) and is removed;
- a file that fails a check (truncated, corrupt, another key, refused by llama.cpp)
  is skipped with one warning and removed; the engine loads and serves regardless;
- restored files are kept until the next save replaces them, so a process that dies
  before its close still finds them at the next load.

Budget: everything under ``<dir>`` stays within ``budget`` bytes. A save gives its
own set the whole budget (the set just used is the one most likely to serve next)
and then removes other sets, least recently used first (the mtime of their
``key.json``, renewed at each restore and save), until the total fits. Only files
this module writes are ever removed, so a ``<dir>`` that holds other things keeps
them.

Both calls block their thread on disk I/O and llama.cpp; the engine makes them where
no ``llama_decode`` runs (its loop's thread, or ``close()`` after the loop ended).
Neither raises for a disk or file problem: it logs a warning and goes on.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._errors import InvalidArgument

logger = logging.getLogger("tokenbelt.engines.batch")

#: default disk budget of a prefix-cache directory, all models together
DEFAULT_PREFIX_CACHE_DISK = 1 << 30
#: this module's file format (part of the key)
FORMAT = 1
_MAGIC = b"TBKV"
#: magic, format, key sha256, tokens, state bytes, crc32 of tokens and state
_HEADER = struct.Struct("<4sI32sIQI")
_KEY_FILE = "key.json"
_SUFFIX = ".kv"
_TEMP = ".tmp"
#: bytes hashed at each end of the model file
_EDGE = 1 << 20


def check_disk_budget(value: int) -> int:
    """A disk budget is a whole number of bytes >= 0 (0: nothing is written)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"prefix_cache_disk must be a number of bytes >= 0, got {value!r}")
    return value


def model_key(lib: Any, model: Any, path: Path, kv_type: str) -> dict[str, Any]:
    """What a saved set's cells depend on (see the module docstring)."""
    path = path.resolve()
    st = path.stat()
    edges = hashlib.sha256()
    with path.open("rb") as f:
        edges.update(f.read(_EDGE))
        f.seek(max(0, st.st_size - _EDGE))
        edges.update(f.read(_EDGE))
    return {
        "format": FORMAT,
        "model": {
            "path": str(path),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino,
            "edges_sha256": edges.hexdigest(),
        },
        "n_embd": int(lib.llama_model_n_embd(model)),
        "n_layer": int(lib.llama_model_n_layer(model)),
        "kv_type": kv_type,
        "llama_cpp": str(getattr(lib, "__version__", "")),
        "state_format": int(getattr(lib, "LLAMA_STATE_SEQ_VERSION", 0)),
    }


class _BadEntry(Exception):
    """An entry file that fails a check (its message says which)."""


@dataclass(frozen=True)
class Restored:
    """One entry read back: its tokens and the state llama.cpp took
    (``llama_state_seq_get_data``'s bytes, as saved)."""

    tokens: list[int]
    state: Any


class PrefixStore:
    """One model's saved prefix-cache set under ``root`` (see the module docstring)."""

    def __init__(self, root: Path, budget: int, key: dict[str, Any]) -> None:
        self.root = root
        self.budget = budget
        self.key = key
        text = json.dumps(key, sort_keys=True)
        self.digest = hashlib.sha256(text.encode("utf-8")).digest()
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(key["model"]["path"]).stem)[:64]
        self.dir = root / f"{stem}-{self.digest.hex()[:16]}"

    # -- restore -----------------------------------------------------------------------------

    def restore(
        self,
        accepts: Callable[[list[int], Any], bool],
        *,
        max_entries: int,
        max_tokens: int,
        max_entry_tokens: int,
        n_vocab: int,
    ) -> list[Restored]:
        """Read the saved entries, most recently used first, while they fit in
        ``max_entries`` and ``max_tokens``; first remove the model's stale sets. Each is
        kept only if ``accepts(tokens, state)`` (llama.cpp takes the state as the cells
        of exactly those tokens); one longer than ``max_entry_tokens`` (a sequence's
        cells) could serve no request and is skipped. Returns them most recently used
        first."""
        try:
            self._remove_stale()
            files = sorted(self.dir.glob("*" + _SUFFIX)) if self.dir.is_dir() else []
        except OSError as exc:
            logger.warning("prefix cache %s: cannot read it: %s", self.dir, exc)
            return []
        restored: list[Restored] = []
        used = 0
        for file in files:
            if len(restored) >= max_entries:
                break
            read = self._read(file, min(max_tokens - used, max_entry_tokens), n_vocab)
            if read is None:
                continue
            tokens, state = read
            if not accepts(tokens, state):
                self._reject(file, "llama.cpp did not accept its state")
                continue
            restored.append(Restored(tokens, state))
            used += len(tokens)
        if restored:
            self._touch()
        return restored

    def _read(self, file: Path, room: int, n_vocab: int) -> tuple[list[int], Any] | None:
        """An entry's tokens and state, or None (a bad file is removed, with a warning;
        one that does not fit in ``room`` tokens is left for a later save to replace)."""
        try:
            return self._parse(file, room, n_vocab)
        except _BadEntry as exc:
            self._reject(file, str(exc))
        except OSError as exc:
            logger.warning("prefix cache entry %s skipped: %s", file, exc)
        return None

    def _parse(self, file: Path, room: int, n_vocab: int) -> tuple[list[int], Any] | None:
        with file.open("rb") as f:
            head = f.read(_HEADER.size)
            if len(head) != _HEADER.size:
                raise _BadEntry("truncated header")
            magic, fmt, digest, n, size, crc = _HEADER.unpack(head)
            if magic != _MAGIC or fmt != FORMAT:
                raise _BadEntry("not a tokenbelt prefix-cache entry")
            if digest != self.digest:
                raise _BadEntry("saved under another key")
            if n == 0:
                raise _BadEntry("no tokens")
            if n > room:
                return None
            if size > file.stat().st_size:
                raise _BadEntry("truncated")  # before a buffer of that size is made
            raw = f.read(4 * n)
            state = (ctypes.c_uint8 * size)()
            got = f.readinto(state)
            if len(raw) != 4 * n or got != size or f.read(1):
                raise _BadEntry("truncated or too long")
        if zlib.crc32(state, zlib.crc32(raw)) != crc:
            raise _BadEntry("checksum mismatch")
        tokens = array.array("i")
        tokens.frombytes(raw)
        if any(t < 0 or t >= n_vocab for t in tokens):
            raise _BadEntry("tokens outside the vocabulary")
        return tokens.tolist(), state

    def _reject(self, file: Path, why: str) -> None:
        logger.warning("prefix cache entry %s skipped (%s) and removed", file, why)
        with contextlib.suppress(OSError):
            file.unlink()

    def _remove_stale(self) -> None:
        """Remove every set of this model's path saved under another key."""
        path = self.key["model"]["path"]
        for other, key in self._sets():
            if other != self.dir and key is not None and key.get("model", {}).get("path") == path:
                logger.info("prefix cache %s is stale (the model or its settings changed)", other)
                _remove_set(other)

    # -- save --------------------------------------------------------------------------------

    def save(self, entries: list[tuple[list[int], Any]]) -> tuple[int, int]:
        """Write ``entries`` (tokens, their cells' state from ``llama_state_seq_get_data``;
        most recently used first) while they fit in the budget, replacing the set saved
        before; then prune other sets to the budget. An entry whose tokens start a more
        recent one's is left out (the other serves every prompt it would). Returns
        (entries written, bytes on disk)."""
        try:
            return self._save(entries)
        except OSError as exc:
            logger.warning("prefix cache %s: not saved: %s", self.dir, exc)
            return 0, 0

    def _save(self, entries: list[tuple[list[int], Any]]) -> tuple[int, int]:
        if not entries and not self.dir.exists():
            return 0, 0  # nothing to write, nothing to replace: no folder is made
        self.dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.dir.glob("*" + _TEMP):  # a save that died half way
            leftover.unlink(missing_ok=True)
        key_bytes = json.dumps({"key": self.key}, sort_keys=True, indent=1).encode("utf-8")
        used = len(key_bytes)
        written: set[str] = set()
        kept: list[list[int]] = []
        for tokens, state in entries:
            if any(tokens == other[: len(tokens)] for other in kept):
                continue  # a more recent entry holds all of it: it would serve nothing
            size = len(state)
            total = _HEADER.size + 4 * len(tokens) + size
            if size == 0 or used + total > self.budget:
                continue  # a smaller, less recent entry may still fit
            raw = array.array("i", tokens).tobytes()
            crc = zlib.crc32(state, zlib.crc32(raw))
            head = _HEADER.pack(_MAGIC, FORMAT, self.digest, len(tokens), size, crc)
            name = f"{len(written):04d}{_SUFFIX}"
            _write_atomically(self.dir / name, head, raw, memoryview(state))
            written.add(name)
            kept.append(tokens)
            used += total
        for old in self.dir.glob("*" + _SUFFIX):
            if old.name not in written:
                old.unlink(missing_ok=True)
        if written:
            _write_atomically(self.dir / _KEY_FILE, key_bytes)
        else:
            _remove_set(self.dir)
        self._prune()
        return len(written), (used if written else 0)

    def _prune(self) -> None:
        """Remove other sets, least recently used first, until all fit the budget."""
        sets = [(d, _set_bytes(d), _last_used(d)) for d, _ in self._sets()]
        total = sum(size for _, size, _ in sets)
        for d, size, _ in sorted(sets, key=lambda s: s[2]):
            if total <= self.budget:
                break
            if d != self.dir:
                _remove_set(d)
                total -= size

    def _touch(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.dir / _KEY_FILE)

    def _sets(self) -> Iterator[tuple[Path, dict[str, Any] | None]]:
        """Every set directory under the root, with its key (None: unreadable)."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if not d.is_dir() or not ((d / _KEY_FILE).exists() or any(d.glob("*" + _SUFFIX))):
                continue  # not one of ours
            try:
                key = json.loads((d / _KEY_FILE).read_text("utf-8"))["key"]
            except (OSError, ValueError, KeyError, TypeError):
                key = None
            yield d, key if isinstance(key, dict) else None


def _write_atomically(path: Path, *parts: bytes | memoryview) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=_TEMP)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _set_bytes(d: Path) -> int:
    total = 0
    for f in d.iterdir():
        with contextlib.suppress(OSError):
            total += f.stat().st_size
    return total


def _last_used(d: Path) -> float:
    for f in (d / _KEY_FILE, d):
        with contextlib.suppress(OSError):
            return f.stat().st_mtime
    return 0.0


def _remove_set(d: Path) -> None:
    """Remove a set's own files (and the directory once empty): nothing else."""
    with contextlib.suppress(OSError):
        for f in d.iterdir():
            if f.suffix in (_SUFFIX, _TEMP) or f.name == _KEY_FILE:
                f.unlink(missing_ok=True)
        d.rmdir()
