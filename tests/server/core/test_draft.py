"""``tokenbelt serve``: drafting by default, through the worker pipe and HTTP.

A real ``tokenbelt serve`` process with the real default model in a worker process (the
counts and the decision come back with ``Release``); drafting is on by default (it
decides for itself where it pays) and a request turns it off with ``tokenbelt.draft``.
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
    # The end token ignored: long enough that a reply whose shadow drafts are all accepted
    # verifies one even while a loaded machine's step costs say no (``Lookup.probe``).
    body = {
        "messages": REPEAT,
        "max_tokens": 96,
        "ignore_eos": True,
        "temperature": 0,
        "tokenbelt": tokenbelt,
    }
    return plainhttp.post(f"{url}/v1/chat/completions", json=body, timeout=NET)


def test_drafting_over_http_in_a_worker_process(tmp_path: Path) -> None:
    extra = ("--isolation", "process", "--prefix-cache-disk", "0")
    with serve_default_model(tmp_path, 90.0, extra) as url:
        drafted = chat(url, capacity=32)  # no setting: the default drafts where it pays
        assert drafted.status_code == 200, drafted.text
        trace = drafted.json()["tokenbelt"]["trace"]
        assert trace["draft_tokens"] > 0
        assert 0 < trace["accepted_draft_tokens"] <= trace["draft_tokens"]
        assert trace["draft_decision"] == "on"

        plain = chat(url, capacity=32, draft="off")
        assert plain.status_code == 200, plain.text
        assert plain.json()["tokenbelt"]["trace"]["draft_tokens"] == 0
        assert plain.json()["tokenbelt"]["trace"]["draft_decision"] == "asked_off"
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
        assert 'tokenbelt_draft_requests_total{decision="on",model=' in metrics
        assert 'tokenbelt_draft_requests_total{decision="asked_off",model=' in metrics
        # The row costs drafting weighed: a step of 2 or more tokens over one of one.
        costs = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("tokenbelt_draft_row_cost{")
        ]
        assert costs, metrics
        assert all(c > 0 for c in costs), costs
