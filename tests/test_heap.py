"""Freezing what a server built at start (``tokenbelt._heap``)."""

from __future__ import annotations

import gc

from tokenbelt._heap import freeze_startup_heap


def test_what_the_process_held_is_out_of_the_collectors_reach_after_the_freeze() -> None:
    held = [[i] for i in range(20_000)]  # what a start builds and keeps (lists: tracked)
    ids = {id(d) for d in held}
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(held)
        # A full collection walks what get_objects lists: none of the frozen objects.
        assert not any(id(o) in ids for o in gc.get_objects())
        made_later: list[list[int]] = [[]]
        assert any(o is made_later for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert sum(id(o) in ids for o in gc.get_objects()) == len(held)
