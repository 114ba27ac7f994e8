"""``tokenbelt serve --draft lookup``: drafting through the CLI, the worker pipe and HTTP.

A real ``tokenbelt serve`` process with the real default model in a worker process (the
option crosses the pipe in ``Load``, the counts come back with ``Release``); the request
asks for drafting or none with ``tokenbelt.draft``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

import plainhttp
from serving import serve_default_model

pytestmark = pytest.mark.model

#: a safety net for every wait, never the assertion itself
NET = 60.0
COUNTING = ", ".join(str(n) for n in range(1, 11))
REPEAT = [{"role": "user", "content": "Repeat this line four times, nothing else:\n" + COUNTING}]


def chat(url: str, **tokenbelt: Any) -> httpx.Response:
    body = {"messages": REPEAT, "max_tokens": 64, "temperature": 0, "tokenbelt": tokenbelt}
    return plainhttp.post(f"{url}/v1/chat/completions", json=body, timeout=NET)


def test_drafting_over_http_in_a_worker_process(tmp_path: Path) -> None:
    extra = ("--draft", "lookup", "--isolation", "process", "--prefix-cache-disk", "0")
    with serve_default_model(tmp_path, 90.0, extra) as url:
        drafted = chat(url, capacity=32)
        assert drafted.status_code == 200, drafted.text
        trace = drafted.json()["tokenbelt"]["trace"]
        assert trace["draft_tokens"] > 0
        assert 0 < trace["accepted_draft_tokens"] <= trace["draft_tokens"]

        plain = chat(url, capacity=32, draft="off")
        assert plain.status_code == 200, plain.text
        assert plain.json()["tokenbelt"]["trace"]["draft_tokens"] == 0
        text = drafted.json()["choices"][0]["message"]["content"]
        assert plain.json()["choices"][0]["message"]["content"] == text

        bad = chat(url, draft="sometimes")
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "tokenbelt.draft"
        assert "'lookup' or 'off'" in error["message"], error

        metrics = plainhttp.get(f"{url}/metrics", timeout=NET).text
        assert "tokenbelt_batch_draft_tokens_total" in metrics
        assert "tokenbelt_batch_draft_accepted_tokens_total" in metrics
