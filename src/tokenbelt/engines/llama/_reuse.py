"""Shifted reuse: the chunks of a prefix-cache entry that a new prompt holds further on.

Consecutive completions of one file share almost all of their prompt, but not as a
prefix: the FIM layout puts the suffix after the prefix, so a keystroke changes a token
or two in the middle of the prompt and everything after it would be computed again. As
llama.cpp's server does with ``--cache-reuse N``, the cells of each chunk of at least N
tokens of the entry that the prompt holds in the same order are kept and moved to their
new positions (``llama_memory_seq_add``: llama.cpp rotates their keys by the shift), and
the cells between them are removed.

llama.cpp looks for a chunk only where the prompt's next token is, so it bridges text
removed from the old prompt and nothing else: a typed character is new text before the
suffix, and its server computes the suffix again. Here a chunk may also start a few
tokens further into the prompt; those tokens (a gap: the text typed) are computed before
the chunk's cells join the sequence (``PrefixCache.reuse``), up to ``most_gap`` tokens
in all.

A chunk's cells were computed after the entry's text, not the new prompt's: what the
model reads from them is what it read then, so a reply may differ from one computed
cold. ``cache_reuse=0`` turns it off.

Pure Python: ``tests/engines/llama/test_reuse.py`` runs it without a model.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Chunk:
    """``n`` cells of an entry, at position ``cached`` there, that the new prompt holds
    at position ``at``."""

    cached: int
    at: int
    n: int

    @property
    def shift(self) -> int:
        """How far the cells move (llama.cpp's ``delta``)."""
        return self.at - self.cached


def find_chunks(
    cached: list[int], prompt: list[int], start: int, *, least: int, limit: int, most_gap: int
) -> list[Chunk]:
    """The chunks of ``cached`` past its first ``start`` tokens (the prefix it shares
    with ``prompt``) that ``prompt`` holds past its own first ``start``: in the same
    order in both, each at least ``least`` tokens and ending by the prompt's ``limit``,
    with at most ``most_gap`` prompt tokens before and between them that no chunk holds
    (0: only chunks that start where the last one ended, as llama.cpp's).

    Each chunk is the first place from where the last one ended in ``cached`` that holds
    the prompt's next ``least`` tokens, as long as they go on matching. The search is a
    byte search over the token ids, so a long entry costs milliseconds, not a scan per
    prompt token in Python."""
    if least < 1 or len(cached) - start < least:
        return []
    haystack = array("i", cached).tobytes()
    chunks: list[Chunk] = []
    head_c = head_p = start
    gap = 0
    q = start
    while q + least <= limit and gap + (q - head_p) <= most_gap:
        if q == head_p and not _may_start(haystack, prompt, q, head_c, least, most_gap - gap):
            break
        i = _find(haystack, array("i", prompt[q : q + least]).tobytes(), head_c)
        if i < 0:
            q += 1
            continue
        n = least
        while i + n < len(cached) and q + n < limit and cached[i + n] == prompt[q + n]:
            n += 1
        gap += q - head_p
        chunks.append(Chunk(i, q, n))
        head_c, head_p = i + n, q + n
        q = head_p
    return chunks


def _may_start(
    haystack: bytes, prompt: list[int], q: int, head_c: int, least: int, room: int
) -> bool:
    """Whether a chunk may start within ``room`` tokens of the prompt's ``q``: each one
    that does holds the prompt's tokens from ``q + room`` to ``q + least``, so one
    search for them spares a search per start when none does (an entry with nothing in
    common past the prefix costs one search, not ``room``)."""
    if room >= least:
        return True
    return _find(haystack, array("i", prompt[q + room : q + least]).tobytes(), head_c) >= 0


def _find(haystack: bytes, needle: bytes, start: int) -> int:
    """The first token position from ``start`` where the token ids ``needle`` are in
    ``haystack`` (both as native 4-byte ids), or -1."""
    width = array("i").itemsize
    at = haystack.find(needle, start * width)
    while at >= 0 and at % width:  # a match across two ids' bytes: not a token match
        at = haystack.find(needle, at + 1)
    return at // width if at >= 0 else -1


def removed(start: int, chunks: list[Chunk]) -> list[tuple[int, int]]:
    """The entry's cell ranges ``[p0, p1)`` that no chunk keeps, past the shared
    prefix of ``start`` tokens (the last one open: ``p1`` -1)."""
    ranges: list[tuple[int, int]] = []
    edge = start
    for chunk in chunks:
        if chunk.cached > edge:
            ranges.append((edge, chunk.cached))
        edge = chunk.cached + chunk.n
    ranges.append((edge, -1))
    return ranges


def moves(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks to shift, in an order where none lands on cells another chunk still
    holds: those moving right from the last, then those moving left from the first
    (llama.cpp's shift takes a sequence's cells by position)."""
    right = [c for c in reversed(chunks) if c.shift > 0]
    return right + [c for c in chunks if c.shift < 0]
