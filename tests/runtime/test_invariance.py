"""Greedy text that does not depend on what shares a request's steps.

With a q8_0 KV cache (``kv_type="q8_0"``), llama.cpp's CPU flash attention computes every
row with the same kernel whatever its step holds, so one prompt's greedy reply is the same
text run cold and alone, from the prefix cache, with prompt-lookup drafting (whose verify
steps hold several rows of it) and beside three other streams. The prompt (~620 tokens)
is long enough for llama.cpp's f16 kernels to take their other paths (a lone row over 512
or more cells splits its attention across the threads; 64 rows or more take a tiled
kernel; both only for f16 or f32 keys): with ``kv_type="f16"`` the batched reply parts
from the cold one at a near tie (measured: after 93 of 598 characters).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tokenbelt import Model, Runtime
from tokenbelt.models import default_model_path

from . import NET

pytestmark = pytest.mark.model

THINGS = ("mill", "bridge", "barn", "chapel", "forge", "inn", "school", "bakery")
PLACES = ("river", "hill", "road", "square", "wood", "lake")
#: a ~600-token document the reply copies (a lookup drafts it)
DOCUMENT = " ".join(
    f"The {THINGS[i % len(THINGS)]} by the {PLACES[i % len(PLACES)]} was built in {1700 + 7 * i} "
    f"and has {i % 5 + 2} rooms."
    for i in range(30)
)
EDIT = [
    {
        "role": "user",
        "content": DOCUMENT + "\n\nRewrite the text above exactly, changing only 'river' to "
        "'stream'.",
    }
]
TOKENS = 200
GREEDY: dict[str, Any] = {"max_tokens": TOKENS, "temperature": 0.0}


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    rt = Runtime(slots=4, keep_alive=None, n_ctx=1024, kv_type="q8_0", capacity=32)
    try:
        yield rt.load(str(default_model_path()))
    finally:
        rt.close()


def test_greedy_text_is_the_same_cold_cached_drafted_and_batched(model: Model) -> None:
    cold = model.complete(EDIT, draft="off", **GREEDY)
    assert cold.trace.prompt_tokens > 512
    assert cold.trace.cached_tokens < 64  # at most the template's head, kept at load
    cached = model.complete(EDIT, draft="off", **GREEDY)
    assert cached.trace.cached_tokens > 512
    drafted = model.complete(EDIT, draft="lookup", **GREEDY)
    assert drafted.trace.accepted_draft_tokens > 0  # some tokens came from verify steps

    others = [
        model.stream([{"role": "user", "content": f"Tell me story {n} about the sea."}], **GREEDY)
        for n in range(3)
    ]
    readers = [threading.Thread(target=s.read) for s in others]
    for t in readers:
        t.start()
    batched = model.stream(EDIT, draft="off", **GREEDY).read()
    for t in readers:
        t.join(NET)
    assert max(len(s.trace.batched_with) for s in (batched, *others)) > 0

    assert cold.trace.completion_tokens == TOKENS
    for reply in (cached, drafted, batched):
        assert reply.text == cold.text
