"""A served alias whose file cannot be had answers 503 ``model_unavailable``, once.

A real ``tokenbelt serve`` with a catalog of the test's own: a chat model whose file is
the default model's, beside one whose download URL nothing listens on.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import openai
import pytest

import plainhttp
from serving import free_port, serve
from tokenbelt.models import Home, default_model_path

pytestmark = pytest.mark.model

NET = 60.0


def _catalog(nowhere: str) -> None:
    path = default_model_path()
    variant = {
        "device": "cpu",
        "size": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    entries = [
        {
            "alias": name,
            "family": "smollm2",
            "license": "Apache-2.0",
            "context_length": 2048,
            "variants": [{**variant, "id": f"{name}-cpu", "source": source}],
        }
        for name, source in (
            ("here-chat", {"type": "path", "path": str(path)}),
            ("gone-chat", {"type": "url", "url": nowhere}),
        )
    ]
    file = Home.from_env().catalog_file
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"version": 1, "models": entries}))


def test_a_model_whose_download_fails_is_a_503_the_sdk_does_not_retry(
    tmp_path: Path, tokenbelt_home: Path
) -> None:
    _catalog(f"http://127.0.0.1:{free_port()}/gone.gguf")  # nothing listens there
    with serve(tmp_path, "here-chat", "gone-chat", log_level="info", timeout=NET) as (url, _):
        body = {"model": "gone-chat", "messages": [{"role": "user", "content": "hi"}]}
        answer = plainhttp.post(f"{url}/v1/chat/completions", json=body, timeout=NET)
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["param"]) == ("model_unavailable", "model")
        assert "cannot connect" in error["message"]
        assert answer.headers["x-should-retry"] == "false"
        # The openai SDK retries a 5xx unless told not to: one attempt, one download.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2)
        began = time.monotonic()
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="gone-chat", messages=body["messages"])
        assert time.monotonic() - began < 5.0
        client.close()
        # The other model serves, and the log says why the first could not be loaded.
        body["model"] = "here-chat"
        body["max_tokens"] = 2
        assert plainhttp.post(f"{url}/v1/chat/completions", json=body, timeout=NET).is_success
    text = (tmp_path / "serve.log").read_text()
    assert "ERROR tokenbelt.runtime: model gone-chat could not be loaded" in text, text
    assert "Traceback" not in text, text
