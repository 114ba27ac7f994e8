"""Greedy text that does not depend on what shares a request's steps.

With a q8_0 KV cache (``kv_type="q8_0"``), llama.cpp's CPU flash attention computes every
row with the same kernel whatever its step holds, so one prompt's greedy reply is the same
text run cold and alone, from the prefix cache, with prompt-lookup drafting (whose verify
steps hold several rows of it) and beside three other streams. The prompt (~480 tokens,
680 cells with the reply) is long enough for llama.cpp's f16 kernels to take their other
paths (a lone row over 512 or more cells splits its attention across the threads; 64 rows
or more take a tiled kernel; both only for f16 or f32 keys): with ``kv_type="f16"`` these
texts part at a near tie within the reply (measured: after 577 characters).
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

PASSAGE = (
    "The old mill stood at the bend of the river, where the water slowed and spread into a "
    "wide, quiet pool. For more than a hundred years the wheel had turned there, grinding "
    "wheat for the farms of the valley, and the miller's family had lived in the stone house "
    "beside it. In spring the river rose with melting snow from the hills, and the children "
    "of the village came to watch the wheel throw white spray into the air. In summer the "
    "water fell low, and the miller opened the sluice gate only in the mornings, when the air "
    "was cool and the farmers brought their carts along the dusty road. Autumn was the "
    "busiest season. The carts came in a long line, loaded with sacks of grain, and the "
    "miller worked from dawn until the lamps were lit. His wife kept the accounts in a thick "
    "leather book, writing each name and each weight in careful letters, and his daughter "
    "carried bread and cheese to the men who waited by the door. Winter was quiet. Ice "
    "formed at the edges of the pool, and the wheel was locked so that it would not crack in "
    "the cold. The family mended sacks, sharpened the grinding stones, and told stories by "
    "the fire. When the railway came to the valley, the farmers began to send their grain to "
    "the big mills in the city, where steam engines turned the stones faster than any river "
    "could. Year by year the line of carts grew shorter. The miller's daughter, grown and "
    "married, moved to the city with her husband, and the old man kept the wheel turning for "
    "the few neighbours who still came. When he died, the house stood empty for a long time. "
    "The roof began to leak, the windows broke, and ivy climbed over the walls. Then, one "
    "spring, a young couple from the city bought the mill. They cleared the ivy, mended the "
    "roof, and repaired the wheel with new oak paddles. Now the mill grinds flour again, "
    "though only on weekends, and visitors come from far away to buy bread baked from wheat "
    "that was ground by the river, just as it was a hundred years ago."
)
EDIT = [
    {
        "role": "user",
        "content": PASSAGE + "\n\nRewrite the text above exactly, changing only 'river' to "
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
    assert cold.trace.prompt_tokens + TOKENS > 600  # past 512 cells early in the reply
    assert cold.trace.cached_tokens < 64  # at most the template's head, kept at load
    cached = model.complete(EDIT, draft="off", **GREEDY)
    assert cached.trace.cached_tokens > 400
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
