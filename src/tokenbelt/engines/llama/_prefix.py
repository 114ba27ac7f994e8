"""The batch engine's KV cells by owner: sequence ids, and the prefix cache.

A sequence that ends (naturally, or stopped: what it computed before the stop) leaves
its cells' contents as a cache entry (up to ``entries`` entries and ``tokens`` tokens,
least recently used evicted first; a sequence longer than ``tokens`` leaves its first
``tokens``: a long agent prompt's instructions and tools are its shared part); one that
failed does not. Entries are held in this process's memory
(``llama_state_seq_get_data``), not as cells of the KV cache: every row of a step looks
at every cell up to the highest one in use, so cells kept for later slowed every stream
(a lone stream of the default model: 156 tok/s with the cache empty, 112 after a few
batches had filled it). A new request whose prompt shares a prefix with an entry gets
those cells back (``llama_state_seq_set_data``, a copy: 2-6 ms for 1,500 tokens of the
default model) and evaluates only the rest; one that shares a prefix with a running
sequence copies its cells (``llama_memory_seq_cp``). ``entries=0`` turns it off: every
prompt is then computed in full.

Past the shared prefix, an entry's chunks of at least ``shift_least`` tokens that the
prompt holds further on keep their cells too, moved to where the prompt has them
(``_reuse.py``): the suffix of a code completion after a keystroke. Only code completions
(``GenerationRequest.infill``) move cells: moved cells were computed after other text, so
greedy text from them may differ from cold, and chat keeps its cold text. The tokens before
such a chunk that no chunk holds (the text typed) are computed first, in a spare
sequence id that holds the cells before them, then given to the sequence, so that its
cells always hold the first ``n_past`` tokens of its prompt and nothing else. Only an
entry's cells move: a running sequence's are shared with it.

With a ``PrefixStore`` the entries outlive the engine: ``save()`` at close writes them,
``restore()`` at the next load of the same model with the same KV settings reads them
back before any request runs (``_persist.py``).

Threads: the engine's loop only (llama.cpp's state calls use the context).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..._errors import IllegalState
from ...belt import RANGES
from ._persist import PrefixStore
from ._plan import common_prefix
from ._reuse import Chunk, find_chunks, moves, removed
from ._sequence import Sequence

logger = logging.getLogger("tokenbelt.engines.batch")

#: llama.cpp's LLAMA_MAX_SEQ: the most sequence ids a context has (where ``slots`` ends)
MAX_SEQUENCES = int(RANGES["slots"].high)
#: computes prompt tokens as a sequence's next cells: (tokens, first position, sequence
#: id) -> whether they were computed
Compute = Callable[[list[int], int, int], bool]


class CacheEntry:
    """A prefix-cache entry: its tokens and its cells' contents, held in this process's
    memory (``llama_state_seq_get_data``), not in the KV cache."""

    __slots__ = ("state", "tokens")

    def __init__(self, tokens: list[int], state: Any) -> None:
        self.tokens = tokens
        self.state = state


class PrefixCache:
    """Sequence ids, their cells, and the prefix cache's entries (module docstring)."""

    def __init__(
        self,
        lib: Any,
        ctx: Any,
        *,
        n_seq_max: int,
        entries: int,
        tokens: int,
        shift_least: int,
        most_gap: int,
        context_length: int,
        n_vocab: int,
        store: PrefixStore | None,
        name: str,
    ) -> None:
        self._lib = lib
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        #: the most entries, and the most tokens of all entries together (0: off)
        self.max_entries = max(0, entries)
        self.max_tokens = max(0, tokens) if self.max_entries else 0
        #: the shortest chunk of an entry kept past the shared prefix (0: none; a model
        #: whose cells cannot move, ``llama_memory_can_shift``, has none)
        self.shift_least = max(0, shift_least)
        if self.shift_least and not lib.llama_memory_can_shift(self._mem):
            logger.info("%s: this model's KV cells cannot be shifted: no cache reuse", name)
            self.shift_least = 0
        #: the most prompt tokens computed between an entry's chunks (a step of its own)
        self.most_gap = most_gap
        self._context_length = context_length
        self._n_vocab = n_vocab
        self._store = store
        self._name = name
        #: in order of use: the first entry is always the least recently used
        self.entries: list[CacheEntry] = []
        self._free_ids = list(range(n_seq_max - 1, -1, -1))
        #: the chat template's head that the warm-up computed (never saved)
        self.head: list[int] = []
        self.hits = 0
        self.hit_tokens = 0
        self.restored = (0, 0)  # entries, tokens
        self.saved = (0, 0)  # entries, bytes

    @property
    def on(self) -> bool:
        return self.max_entries > 0

    # -- sequence ids and cells --------------------------------------------------------------

    def take_id(self) -> int:
        if not self._free_ids:  # pragma: no cover - at most ``slots`` requests hold one
            raise IllegalState("no free sequence id")
        return self._free_ids.pop()

    @property
    def spare(self) -> bool:
        """Whether an id is free beside the running sequences': the engine has one more
        than its slots (but at ``MAX_SEQUENCES`` slots), for a shifted reuse's gap; the
        warm-up and a restore use one while nothing runs. Entries hold none."""
        return bool(self._free_ids)

    def free(self, seq_id: int) -> None:
        """Free sequence ``seq_id``'s cells and the id."""
        self._lib.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        self._free_ids.append(seq_id)

    def cut(self, seq_id: int, keep: int) -> None:
        """Remove sequence ``seq_id``'s cells from position ``keep`` on."""
        self._lib.llama_memory_seq_rm(self._mem, seq_id, keep, -1)

    def kept(self, seq_id: int) -> int:
        """How many positions sequence ``seq_id``'s cells hold (after an aborted step)."""
        return int(self._lib.llama_memory_seq_pos_max(self._mem, seq_id)) + 1

    # -- a new sequence's prefix -------------------------------------------------------------

    def reuse(
        self, seq: Sequence, running: Iterable[Sequence], compute: Compute
    ) -> tuple[int, int]:
        """Give ``seq`` (holding an id) the longest cached prefix of its prompt, from an
        entry or a running sequence, and an entry's chunks past it, ``compute`` computing
        the tokens between them (module docstring): (how many of the prompt's first
        tokens its cells now hold, how many of those were reused: counted as hits)."""
        # Only a code completion's cells move: chat and other prompts keep the greedy text
        # they have cold (moved cells were computed after other text).
        shift = seq.request.infill
        n, source, entry, chunks = self._best(seq.tokens, running, exclude=seq, shift=shift)
        reused = n
        if entry is not None:
            if not self._load(entry, seq.id):
                n = reused = 0  # its cells did not go back in: the prompt is computed
            else:
                n, reused = self._shifted(seq, n, chunks, compute)
        elif n > 0:
            self._lib.llama_memory_seq_cp(self._mem, source, seq.id, 0, n)
        if reused > 0:
            self.hits += 1
            self.hit_tokens += reused
        return n, reused

    def _shifted(
        self, seq: Sequence, n: int, chunks: list[Chunk], compute: Compute
    ) -> tuple[int, int]:
        """Keep an entry's cells (loaded as ``seq``'s) for its shared prefix of ``n``
        tokens and its ``chunks`` past it, computing the prompt's tokens between them in
        a spare sequence: (cells, tokens reused). A gap not computed (a stop aborted it)
        ends the reuse there."""
        lib, mem, seq_id = self._lib, self._mem, seq.id
        for p0, p1 in removed(n, chunks):
            lib.llama_memory_seq_rm(mem, seq_id, p0, p1)
        for chunk in moves(chunks):
            lib.llama_memory_seq_add(mem, seq_id, chunk.cached, chunk.cached + chunk.n, chunk.shift)
        reused = cells = n
        for chunk in chunks:
            if chunk.at > cells and not self._gap(seq, cells, chunk.at, compute):
                self.cut(seq_id, cells)
                break
            reused += chunk.n
            cells = chunk.at + chunk.n
        if reused > n:
            logger.debug(
                "%s: %d cached tokens past the shared prefix of %d, moved (%d computed)",
                self._name,
                reused - n,
                n,
                cells - reused,
            )
        return cells, reused

    def _gap(self, seq: Sequence, p0: int, p1: int, compute: Compute) -> bool:
        """Compute ``seq``'s prompt tokens ``[p0, p1)`` in a spare sequence holding its
        cells before ``p0``, and give their cells to ``seq``; whether they were computed
        (llama.cpp computes a sequence's next cells only right after its last)."""
        lib, mem = self._lib, self._mem
        spare = self.take_id()
        try:
            lib.llama_memory_seq_cp(mem, seq.id, spare, 0, p0)
            done = compute(seq.tokens[p0:p1], p0, spare)
            if done:
                lib.llama_memory_seq_cp(mem, spare, seq.id, p0, p1)
            return done
        finally:
            self.free(spare)

    def _best(
        self, tokens: list[int], running: Iterable[Sequence], exclude: Sequence, *, shift: bool
    ) -> tuple[int, int, CacheEntry | None, list[Chunk]]:
        """The most usable cached tokens: (the shared prefix, the running sequence that
        holds it or -1, the cache entry that holds it or None, that entry's chunks past
        it). An entry counts its prefix and its chunks: after a keystroke, the last
        completion computed whole has more of the prompt than a later one stopped in its
        prefill (whose prefix is longer). An entry that serves moves to the end of
        ``entries``, which is kept in order of use."""
        best, most, source, hit = 0, 0, -1, None
        moved: list[Chunk] = []
        if not self.on:
            return best, source, hit, moved  # the prefix cache is off: all is computed
        limit = len(tokens) - 1  # at least one prompt token must be evaluated for logits
        for entry in self.entries:
            n = min(common_prefix(entry.tokens, tokens), limit)
            chunks = self._chunks(entry.tokens, tokens, n, limit) if shift else []
            total = n + sum(c.n for c in chunks)
            if total > most:
                best, most, hit, moved = n, total, entry, chunks
        for seq in running:
            if seq is exclude or seq.id < 0 or seq.cancelled:
                continue
            n = min(common_prefix(seq.tokens[: seq.n_past], tokens), limit)
            if n > most:
                best, most, source, hit, moved = n, n, seq.id, None, []
        if hit is not None:
            self.entries.remove(hit)
            self.entries.append(hit)
        return best, source, hit, moved

    def _chunks(self, cached: list[int], tokens: list[int], n: int, limit: int) -> list[Chunk]:
        """An entry's chunks past its shared prefix of ``n`` tokens (none with
        ``shift_least`` 0; with no spare id, only those that need no gap computed)."""
        if not self.shift_least:
            return []
        most_gap = self.most_gap if self.spare else 0
        least = self.shift_least
        return find_chunks(cached, tokens, n, least=least, limit=limit, most_gap=most_gap)

    def _load(self, entry: CacheEntry, seq_id: int) -> bool:
        """Put ``entry``'s cells back as sequence ``seq_id``'s; False (and nothing left
        in it) when llama.cpp did not take them."""
        if not self._set_state(seq_id, entry.tokens, entry.state):
            self._lib.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            logger.warning("%s: a prefix-cache entry did not go back in; dropped", self._name)
            self.entries.remove(entry)
            return False
        return True

    def _set_state(self, seq_id: int, tokens: list[int], state: Any) -> bool:
        """Put ``state`` into sequence ``seq_id``'s cells; whether they now hold exactly
        the positions of ``tokens`` (else they would serve a prefix they do not hold)."""
        got = self._lib.llama_state_seq_set_data(self._ctx, state, len(state), seq_id)
        return got != 0 and self.kept(seq_id) == len(tokens)

    # -- entries -----------------------------------------------------------------------------

    def retire(self, seq_id: int, tokens: list[int], n_past: int, *, cache: bool) -> None:
        """A sequence left: its first ``n_past`` cells become an entry (``cache``; a
        longer one than the cache holds leaves its head, where another turn starts too),
        then its cells and id are freed."""
        if cache and self.on and n_past > 0:
            kept = min(n_past, self.max_tokens)
            if kept < n_past:
                self.cut(seq_id, kept)
            self.keep(seq_id, tokens[:kept])
        self.free(seq_id)

    def keep(self, seq_id: int, tokens: list[int]) -> None:
        """Copy sequence ``seq_id``'s cells (holding ``tokens``) out of the KV cache into
        an entry; the caller frees the cells."""
        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, seq_id))
        state = (ctypes.c_uint8 * size)()
        if size == 0 or int(lib.llama_state_seq_get_data(self._ctx, state, size, seq_id)) != size:
            logger.warning("%s: llama.cpp gave no state for a prefix-cache entry", self._name)
            return
        self._add(tokens, state)

    def _add(self, tokens: list[int], state: Any) -> None:
        """An entry, the most recently used; the least recently used go past the limits."""
        self.entries.append(CacheEntry(tokens, state))
        while len(self.entries) > self.max_entries or (
            sum(len(e.tokens) for e in self.entries) > self.max_tokens
        ):
            del self.entries[0]

    def clear(self) -> None:
        self.entries.clear()

    # -- outliving the engine ----------------------------------------------------------------

    def _accepts(self, tokens: list[int], state: Any) -> bool:
        """Whether llama.cpp takes ``state`` as the cells of ``tokens``: checked in a free
        sequence, freed again (a saved entry, read back before any request runs)."""
        seq_id = self.take_id()
        try:
            return self._set_state(seq_id, tokens, state)
        finally:
            self.free(seq_id)

    def restore(self) -> None:
        """The loop's first job, before the warm-up: the entries saved at the last close
        of this model become entries (most recently used last)."""
        if self._store is None:
            return
        restored = self._store.restore(
            self._accepts,
            max_entries=self.max_entries,
            max_tokens=self.max_tokens,
            max_entry_tokens=self._context_length,
            n_vocab=self._n_vocab,
        )
        for entry in reversed(restored):
            # Held in memory as every entry is: the state llama.cpp just took, as read.
            self._add(entry.tokens, entry.state)
        self.restored = (len(restored), sum(len(e.tokens) for e in restored))
        if restored:
            logger.info(
                "%s: %d prefix-cache entries (%d tokens) restored from %s",
                self._name,
                *self.restored,
                self._store.dir,
            )

    def save(self) -> None:
        """At close, with the loop ended: write the entries, most recent first."""
        if self._store is None:
            return
        entries = [(e.tokens, e.state) for e in reversed(self.entries) if e.tokens != self.head]
        self.saved = self._store.save(entries)
        if self.saved[0]:
            logger.info(
                "%s: %d prefix-cache entries (%d bytes) saved to %s",
                self._name,
                *self.saved,
                self._store.dir,
            )
