"""The default context fits each model; a context given past a chat model's is refused.

A catalog of the test's own (its home is the test's) whose entries point at the default
model's file: a chat entry that says it was trained on 2,048 tokens and an embedding
entry of 96, beside the default of 4,096.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

import plainhttp
from serving import serve
from tokenbelt import Runtime
from tokenbelt.models import Home, default_model_path

pytestmark = pytest.mark.model

NET = 60.0
#: bytes one token takes in the default model's f16 KV cache: 30 layers, 3 KV heads,
#: keys and values of 64 each, 2 bytes apiece
KV_CELL = 30 * 3 * (64 + 64) * 2


def _entry(alias: str, kind: str, context: int) -> dict[str, Any]:
    path = default_model_path()
    entry: dict[str, Any] = {
        "alias": alias,
        "family": "smollm2",
        "license": "Apache-2.0",
        "context_length": context,
        "kind": kind,
        "variants": [
            {
                "id": f"{alias}-cpu",
                "device": "cpu",
                "size": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "source": {"type": "path", "path": str(path)},
            }
        ],
    }
    if kind == "embedding":
        entry["pooling"] = "last"
    return entry


@pytest.fixture
def catalog(tokenbelt_home: Path) -> None:
    file = Home.from_env().catalog_file
    file.parent.mkdir(parents=True, exist_ok=True)
    entries = [_entry("short-chat", "chat", 2048), _entry("short-embed", "embedding", 96)]
    file.write_text(json.dumps({"version": 1, "models": entries}))


@pytest.mark.usefixtures("catalog")
def test_the_default_context_is_what_a_model_was_trained_on() -> None:
    """An agent's first request (6,000 to 23,000 tokens) fits the default model's own
    8,192 without a flag: the context not given is the trained one, not 4,096."""
    with Runtime(keep_alive=None, slots=1, prefix_cache=False) as rt:
        assert rt.load("short-chat", load_timeout=NET).info["n_ctx_per_seq"] == 2048
        # A file by its path: what its own header says (8,192).
        model = rt.load(str(default_model_path()), load_timeout=NET)
        assert (model.info["context_length"], model.info["n_ctx_per_seq"]) == (8192, 8192)
        assert model.info["memory_estimate"]["kv"] == 8192 * KV_CELL
    # Given, a context is the user's: the file itself was trained on 8,192, which the
    # engine checks (and refuses past it, as test_validation shows).
    with Runtime(keep_alive=None, slots=1, n_ctx=3000, prefix_cache=False) as rt:
        assert rt.load("short-chat", load_timeout=NET).info["n_ctx_per_seq"] == 3000


@pytest.mark.usefixtures("catalog")
def test_serve_starts_a_chat_model_beside_an_embedding_model_trained_on_less(
    tmp_path: Path,
) -> None:
    """``tokenbelt serve smollm2-135m nomic-embed-text-v1.5`` (the README's pair) exited
    2 because the default 4,096 was more than the embedding model's 2,048."""
    with serve(tmp_path, "short-chat", "short-embed", timeout=NET) as (url, _):
        listed = plainhttp.get(f"{url}/v1/models", timeout=NET).json()["data"]
        assert {m["id"] for m in listed} >= {"short-chat", "short-embed"}
        body = {"model": "short-embed", "input": ["the sea"]}
        embedded = plainhttp.post(f"{url}/v1/embeddings", json=body, timeout=NET)
        assert embedded.status_code == 200, embedded.text
        assert len(embedded.json()["data"][0]["embedding"]) == 576
