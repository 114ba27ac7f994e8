"""Shifted reuse's search, without a model: which chunks of an entry a new prompt keeps,
and that removing and moving them as llama.cpp does (its cells taken by position) leaves
every kept cell where the prompt has its token. The real model's keystrokes are
``tests/runtime/test_cache_reuse.py``."""

from __future__ import annotations

import random

from tokenbelt import GenerationRequest
from tokenbelt.belt import Belt
from tokenbelt.engines.llama._plan import common_prefix
from tokenbelt.engines.llama._prefix import PrefixCache
from tokenbelt.engines.llama._reuse import Chunk, find_chunks, moves, removed
from tokenbelt.engines.llama._sequence import Sequence

#: the prompt's last token is computed for its logits: no chunk reaches it
LAST = -1


def search(cached: list[int], prompt: list[int], least: int = 4, most_gap: int = 8) -> list[Chunk]:
    start = 0
    while start < min(len(cached), len(prompt)) and cached[start] == prompt[start]:
        start += 1
    limit = len(prompt) + LAST
    return find_chunks(cached, prompt, start, least=least, limit=limit, most_gap=most_gap)


def cells_after(cached: list[int], start: int, chunks: list[Chunk]) -> dict[int, int]:
    """The entry's cells (position -> token) after the removals and the moves, applied as
    llama.cpp applies ``seq_rm`` and ``seq_add``: to every cell in a position range."""
    cells = list(enumerate(cached))
    for p0, p1 in removed(start, chunks):
        cells = [(p, t) for p, t in cells if not (p >= p0 and (p1 < 0 or p < p1))]
    for chunk in moves(chunks):
        lo, hi = chunk.cached, chunk.cached + chunk.n
        cells = [(p + chunk.shift if lo <= p < hi else p, t) for p, t in cells]
    at = dict(cells)
    assert len(at) == len(cells), "two cells landed on one position"
    return at


def test_a_typed_character_keeps_the_text_after_it_past_a_gap() -> None:
    head, tail = list(range(100, 120)), list(range(200, 240))
    cached = [*head, 7, *tail, 1, 2]  # the old prompt, then what was generated
    prompt = [*head, 8, 9, *tail, 3]  # a token changed into two: the text typed
    assert search(cached, prompt) == [Chunk(21, 22, 40)]
    cells = cells_after(cached, 20, [Chunk(21, 22, 40)])
    assert cells == {p: prompt[p] for p in [*range(20), *range(22, 62)]}


def test_removed_text_needs_no_gap_as_in_llama_cpp() -> None:
    head, tail = list(range(100, 110)), list(range(200, 230))
    cached = [*head, 7, 7, 7, *tail]
    prompt = [*head, *tail, 5]
    for most_gap in (0, 8):
        assert search(cached, prompt, most_gap=most_gap) == [Chunk(13, 10, 30)]


def test_without_gaps_new_text_keeps_nothing_past_the_prefix() -> None:
    """llama.cpp's own search: a chunk only where the prompt's next token is."""
    head, tail = list(range(100, 110)), list(range(200, 230))
    assert search([*head, 7, *tail], [*head, 8, *tail, 5], most_gap=0) == []


def test_a_chunk_shorter_than_the_least_is_computed_again() -> None:
    head, tail = list(range(100, 110)), list(range(200, 203))
    assert search([*head, 7, *tail, 9], [*head, 8, *tail, 5]) == []


def test_the_gaps_stop_at_their_budget() -> None:
    head, tail = list(range(100, 110)), list(range(200, 220))
    cached = [*head, *tail]
    typed = list(range(300, 309))
    assert search(cached, [*head, *typed, *tail, 5], most_gap=9) == [Chunk(10, 19, 20)]
    assert search(cached, [*head, *typed, *tail, 5], most_gap=8) == []


def test_no_chunk_reaches_the_prompts_last_token() -> None:
    head, tail = list(range(100, 110)), list(range(200, 220))
    prompt = [*head, 8, *tail]
    assert search([*head, 7, *tail], prompt) == [Chunk(11, 11, 19)]


def test_a_match_across_two_token_ids_bytes_is_not_a_chunk() -> None:
    # 256 and 1 as 4-byte ids: 00 01 00 00 01 00 00 00; the bytes of 1 are found one byte
    # in, across both ids, before the id 1 itself.
    assert find_chunks([256, 1], [1, 9], 0, least=1, limit=1, most_gap=0) == [Chunk(1, 0, 1)]


def test_chunks_moving_both_ways_never_land_on_each_other() -> None:
    chunks = [Chunk(10, 14, 6), Chunk(16, 20, 5), Chunk(30, 25, 5), Chunk(35, 30, 4)]
    order = moves(chunks)
    assert order == [chunks[1], chunks[0], chunks[2], chunks[3]]
    cached = list(range(50))
    cells = cells_after(cached, 10, chunks)
    assert sorted(cells) == [*range(10), *range(14, 25), *range(25, 34)]


def test_random_edits_leave_every_kept_cell_at_its_prompt_token() -> None:
    rng = random.Random(5)
    for _ in range(300):
        cached = [rng.randrange(40) for _ in range(rng.randrange(30, 120))]
        prompt = list(cached)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(prompt))
            edit = rng.choice(("insert", "delete", "replace"))
            if edit == "insert":
                prompt[at:at] = [rng.randrange(40) for _ in range(rng.randrange(1, 6))]
            elif edit == "delete":
                del prompt[at : at + rng.randrange(1, 6)]
            else:
                prompt[at] = rng.randrange(40)
        if len(prompt) < 2:
            continue
        start = 0
        while start < min(len(cached), len(prompt)) - 1 and cached[start] == prompt[start]:
            start += 1
        chunks = find_chunks(cached, prompt, start, least=6, limit=len(prompt) - 1, most_gap=5)
        gap = 0
        edge_c = edge_p = start
        for chunk in chunks:
            assert chunk.n >= 6
            assert chunk.cached >= edge_c
            assert chunk.at >= edge_p
            assert (
                cached[chunk.cached : chunk.cached + chunk.n]
                == prompt[chunk.at : chunk.at + chunk.n]
            )
            gap += chunk.at - edge_p
            edge_c, edge_p = chunk.cached + chunk.n, chunk.at + chunk.n
        assert gap <= 5
        assert edge_p <= len(prompt) - 1
        cells = cells_after(cached, start, chunks)
        assert all(prompt[p] == t for p, t in cells.items())
        assert len(cells) == start + sum(c.n for c in chunks)


class Memory:
    """llama.cpp's calls a ``PrefixCache`` makes at its start: whether the model's KV
    cells can be shifted (a recurrent model's and M-RoPE's cannot)."""

    def __init__(self, can_shift: bool) -> None:
        self.can_shift = can_shift

    def llama_get_memory(self, ctx: object) -> object:
        return ctx

    def llama_memory_can_shift(self, memory: object) -> bool:
        return self.can_shift


def prefix_cache(can_shift: bool = True, shift_least: int = 4) -> PrefixCache:
    return PrefixCache(
        Memory(can_shift),
        object(),
        n_seq_max=2,
        entries=8,
        tokens=4096,
        shift_least=shift_least,
        most_gap=8,
        context_length=2048,
        n_vocab=1000,
        store=None,
        name="m",
    )


def test_a_model_whose_cells_cannot_shift_keeps_the_prefix_only() -> None:
    assert prefix_cache(can_shift=False, shift_least=256).shift_least == 0
    assert prefix_cache(can_shift=True, shift_least=256).shift_least == 256


def test_the_entry_with_the_most_cached_tokens_serves_not_the_longest_prefix() -> None:
    """After a burst of keystrokes, the last completion computed whole holds the suffix;
    a later one stopped in its prefill holds a longer prefix and none of it."""
    head, tail = list(range(100, 120)), list(range(200, 240))
    whole, stopped = [*head, 7, *tail, 1], [*head, 8, 9]
    prompt = [*head, 8, 9, 10, *tail, 5]
    seq = Sequence(GenerationRequest(prompt="p"), Belt[str](4).producer, lambda: None)
    cases = ((4, True, whole, [Chunk(21, 23, 40)]), (0, True, stopped, []))
    # A chat or raw prompt (not a code completion) moves no cells: the longest prefix.
    for reuse, shift, entry, chunks in (*cases, (4, False, stopped, [])):
        cells = prefix_cache(shift_least=reuse)
        cells._add(whole, None)
        cells._add(stopped, None)
        n, source, hit, moved = cells._best(prompt, [], exclude=seq, shift=shift)
        assert hit is not None
        assert (hit.tokens, moved, source) == (entry, chunks, -1)
        assert n == common_prefix(entry, prompt)
