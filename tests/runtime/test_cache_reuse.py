"""Shifted reuse on the real model (its FIM copy): a keystroke's completion keeps the
cached cells of the suffix past the typed character (``cache_reuse``), moved to where
the new prompt has them; with ``cache_reuse=0`` only the prefix the two prompts share.

The moved cells were computed after the old text, and their keys are rotated in place
(in a q8_0 cache, quantized again): greedy text from them is not always the cold text.
Measured typing tokenbelt's ``engines/_infill.py`` (29 keystrokes, 24 tokens each, the
entry carried from keystroke to keystroke): with a q8_0 KV cache the first token was the
cold one's in 25 and the whole completion in 5 (with the prefix cache alone: all 29);
with f16, 25 and 10 (prefix cache alone: 29 and 23). So the test of text holds a chosen
completion's first line to the cold one, not its whole text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tokenbelt import EndReason, Runtime, SamplingParams
from tokenbelt.engines import Infill
from tokenbelt.runtime import Model

pytestmark = pytest.mark.model

#: a code file of ~800 tokens; the prompt takes ~270 of them before the cursor, ~510 after
CODE = "".join(
    f"def area_{i}(width, height):\n"
    f'    """The area of rectangle {i}, scaled by {i}."""\n'
    f"    return width * height * {i}\n\n\n"
    for i in range(24)
)
CURSOR = CODE.index("return width * height * 7") + len("return width")
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def keystroke(model: Model, prefix: str) -> tuple[int, int, str]:
    """Complete at the cursor after ``prefix``: (prompt tokens, cached tokens, text)."""
    reply = model.complete_middle(prefix, CODE[CURSOR:], **GREEDY)
    assert reply.end_reason is EndReason.LENGTH
    return reply.trace.prompt_tokens, reply.trace.cached_tokens, reply.text


@contextmanager
def fim_model(fim_gguf: Path, cache_reuse: int) -> Iterator[Model]:
    """The FIM model with ``cache_reuse``, its prefix cache empty."""
    options: dict[str, Any] = {"kv_type": "q8_0", "cache_reuse": cache_reuse}
    with Runtime(slots=1, keep_alive=None, n_ctx=2048, isolation="thread", **options) as rt:
        yield rt.load(str(fim_gguf))


def shared_prefix(model: Model, prefix: str, typed: str) -> int:
    a = model.infill_prompt(Infill(prefix, CODE[CURSOR:]), 8).tokens
    b = model.infill_prompt(Infill(prefix + typed, CODE[CURSOR:]), 8).tokens
    n = 0
    while a[n] == b[n]:
        n += 1
    return n


def test_a_typed_character_keeps_the_cells_past_it(fim_gguf: Path) -> None:
    with fim_model(fim_gguf, 256) as model:
        prompt, cached, _ = keystroke(model, CODE[:CURSOR] + " w")
        assert cached < 64  # nothing of this file was cached yet
        prompt, cached, _ = keystroke(model, CODE[:CURSOR] + " wi")
        assert prompt > 500
        assert shared_prefix(model, CODE[:CURSOR] + " w", "i") < prompt * 0.5
        # All but the typed text's tokens, the suffix's first and the middle token.
        assert cached > prompt * 0.9
        # Two characters taken back (text removed: llama.cpp's own case).
        prompt, cached, _ = keystroke(model, CODE[:CURSOR] + " ")
        assert cached > prompt * 0.9


def test_with_cache_reuse_off_only_the_shared_prefix_is_cached(fim_gguf: Path) -> None:
    with fim_model(fim_gguf, 0) as model:
        keystroke(model, CODE[:CURSOR] + " w")
        prompt, cached, _ = keystroke(model, CODE[:CURSOR] + " wi")
        assert cached == shared_prefix(model, CODE[:CURSOR] + " w", "i") < prompt * 0.5


def test_a_completion_from_moved_cells_starts_as_the_cold_one(fim_gguf: Path) -> None:
    with fim_model(fim_gguf, 256) as model:
        keystroke(model, CODE[:CURSOR] + " w")
        prompt, cached, moved = keystroke(model, CODE[:CURSOR] + " wi")
        assert cached > prompt * 0.9
        infill = Infill(CODE[:CURSOR] + " wi", CODE[CURSOR:])
        request, _ = model.infill_request(infill, SamplingParams(**GREEDY), reuse_prefix=False)
        cold = model.submit(request).read()
    assert cold.trace.cached_tokens == 0
    # The rest of the line the cursor is on (5 tokens), as computed cold.
    assert moved.splitlines()[0] == cold.text.splitlines()[0] == " * height * 21"
