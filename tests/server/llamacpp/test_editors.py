"""Editors that write a FIM prompt's markers as text: Zed's edit predictions.

Zed's Ollama provider (``edit_predictions.ollama``) and its OpenAI-compatible one
(``edit_predictions.open_ai_compatible_api``) do not send ``suffix``: they lay out
``<pre>PREFIX<suf>SUFFIX<mid>`` themselves, in the marker texts of the model's family
(``prompt_format``, inferred from the model's name), and post it as a raw prompt
(Ollama's ``raw: true``). A raw prompt's special tokens are read as those tokens, as
llama.cpp's server, Ollama and vLLM read them; the test model's FIM markers are its
``<issue_*>`` specials (``tests/fimmodel.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import plainhttp
from tokenbelt import Runtime
from tokenbelt.engines.llama import load_vocab
from tokenbelt.server import ServerSettings

from ..conftest import NET, Served, SharedServer, shared_server

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
#: the test model's FIM markers, written as text as Zed writes a family's markers
PROMPT = f"<issue_start>{PREFIX}<issue_comment>{SUFFIX}<issue_closed>"
#: what Zed sends beside the prompt (``crates/edit_prediction/src/ollama.rs``)
ZED_STOP = ["<|endoftext|>", "<|file_separator|>", "<|fim_pad|>", "<fim_prefix>", "<PRE>"]


@pytest.fixture(scope="module")
def shared(module_home: Path, fim_gguf: Path) -> Iterator[SharedServer]:
    def make() -> Runtime:
        runtime = Runtime(keep_alive=None, slots=2)
        runtime.load(str(fim_gguf))
        return runtime

    with shared_server(make, ServerSettings()) as server:
        yield server


def tokens(fim_gguf: Path, *, special: bool) -> int:
    vocab = load_vocab(fim_gguf)
    try:
        return len(vocab.tokenize(PROMPT.encode(), True, special))
    finally:
        vocab.close()


def post(served: Served, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = plainhttp.post(f"{served.url}{path}", json=body, timeout=NET)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_zeds_ollama_edit_prediction_reads_the_markers_as_fim_tokens(
    served: Served, fim_gguf: Path
) -> None:
    body = {
        "model": fim_gguf.stem,
        "prompt": PROMPT,
        "raw": True,
        "stream": False,
        "options": {"num_predict": 12, "temperature": 0.2, "stop": ZED_STOP},
    }
    answer = post(served, "/api/generate", body)
    assert answer["done"] is True
    assert isinstance(answer["response"], str)
    trace = served.recorder.nth(0)
    # Each marker is one token (its special), not the letters of its text.
    assert trace.prompt_tokens == tokens(fim_gguf, special=True)
    assert trace.prompt_tokens < tokens(fim_gguf, special=False) - 6


def test_zeds_openai_compatible_edit_prediction_reads_them_too(
    served: Served, fim_gguf: Path
) -> None:
    body = {"model": fim_gguf.stem, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.2}
    answer = post(served, "/v1/completions", {**body, "stop": ZED_STOP[:4]})
    assert isinstance(answer["choices"][0]["text"], str)
    assert answer["usage"]["prompt_tokens"] == tokens(fim_gguf, special=True)
