"""Code completion on a real server: llama.cpp's ``/infill`` as llama.vim and llama.vscode
send it, ``suffix`` on ``/v1/completions`` (the ``openai`` SDK) and on Ollama's
``/api/generate`` (the ``ollama`` client), supersede keys, both deadlines, and the
honest refusal of a model without FIM tokens on every route.

One server for the module, with the FIM copy of the embedded model (the default) and the
embedded model itself (no FIM tokens).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

import plainhttp
from tokenbelt import EndReason, Runtime
from tokenbelt.cli._ps import table
from tokenbelt.models import default_model_path
from tokenbelt.server import ServerSettings

from ..conftest import LONG_PROMPT, NET, Served, SharedServer, connect_ollama, shared_server

PLAIN = Path(default_model_path()).stem
PREFIX = "def add(a, b):\n"
SUFFIX = "\n\nprint(add(1, 2))\n"
#: what llama.vim's ``s:ring_update`` sends: the ring's chunks only, to warm the cache
VIM_WARM_UP = {
    "id_slot": 0,
    "input_prefix": "",
    "input_suffix": "",
    "input_extra": [{"text": "import os\n", "time": [1733, 52000], "filename": "a.py"}],
    "prompt": "",
    "n_predict": 0,
    "temperature": 0.0,
    "samplers": [],
    "stream": False,
    "cache_prompt": True,
    "t_max_prompt_ms": 1,
    "t_max_predict_ms": 1,
    "response_fields": [""],
}
#: llama.vim's timings fields, as ``llama#fim`` asks for them
VIM_FIELDS = [
    "content",
    "timings/prompt_n",
    "timings/prompt_ms",
    "timings/prompt_per_token_ms",
    "timings/prompt_per_second",
    "timings/predicted_n",
    "timings/predicted_ms",
    "timings/predicted_per_token_ms",
    "timings/predicted_per_second",
    "truncated",
    "tokens_cached",
]


def vim_fim(prefix: str, middle: str, **more: Any) -> dict[str, Any]:
    """``llama#fim``'s request (autoload/llama.vim), field for field."""
    return {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": SUFFIX,
        "input_extra": [{"text": "import os\n", "filename": "a.py"}],
        "prompt": middle,
        "n_predict": 16,
        "stop": [],
        "n_indent": 4,
        "top_k": 40,
        "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 5000,
        "t_max_predict_ms": 1000,
        "response_fields": VIM_FIELDS,
        **more,
    }


@pytest.fixture(scope="module")
def shared(module_home: Path, fim_gguf: Path) -> Iterator[SharedServer]:
    def make() -> Runtime:
        runtime = Runtime(keep_alive=None, slots=4)
        runtime.load(str(fim_gguf))
        runtime.load(str(default_model_path()))
        return runtime

    # No server-wide first-token limit: t_max_prompt_ms is each request's own.
    with shared_server(make, ServerSettings()) as server:
        yield server


def post(served: Served, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return plainhttp.post(f"{served.url}{path}", json=body, timeout=NET, **kwargs)


def final_reason(answer: dict[str, Any]) -> str:
    reason: str = answer["tokenbelt"]["end_reason"]
    return reason


# -- the clients' own requests -------------------------------------------------------------------


def test_llama_vim_warm_up_then_keystrokes_reuse_the_cache(served: Served) -> None:
    warm = post(served, "/infill", VIM_WARM_UP)
    assert warm.status_code == 200, warm.text
    assert warm.json() == {}  # response_fields [""]: nothing asked for
    first = post(served, "/infill", vim_fim(PREFIX, "    ret"))
    assert first.status_code == 200, first.text
    answer = first.json()
    assert set(answer) == set(VIM_FIELDS)
    assert isinstance(answer["content"], str)
    assert answer["truncated"] is False
    # The next keystroke: the prompt shares all but its end with the one before.
    post(served, "/infill", vim_fim(PREFIX, "    retu"))
    warm_trace, one, two = (served.recorder.nth(i) for i in range(3))
    # The warm-up computed the prompt and kept it; it had no prompt deadline.
    assert warm_trace.end_reason is EndReason.LENGTH
    assert one.cached_tokens > 0  # the ring's chunk, from the warm-up
    assert two.cached_tokens > one.cached_tokens  # all but the last few tokens
    assert two.prompt_tokens - two.cached_tokens < one.prompt_tokens - one.cached_tokens


def test_llama_vscode_candidates(served: Served) -> None:
    base = {
        "id_slot": 0,
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"filename": "b.ts", "text": "let x = 1;\n"}],
        "prompt": "    ",
    }
    warm = {**base, "n_predict": 0, "samplers": [], "cache_prompt": True}
    warm |= {"t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    assert post(served, "/infill", warm).json()["content"] == ""
    body = {**base, "n_predict": 12, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False}
    body |= {"samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4}
    body |= {"t_max_prompt_ms": 500, "t_max_predict_ms": 2500}
    answers = post(served, "/infill", body).json()
    assert [a["index"] for a in answers] == [0, 1, 2]
    for a in answers:
        assert isinstance(a["content"], str)
        assert a["stop"] is True
        assert a["stop_type"] in ("eos", "limit")
    candidates = served.recorder.enqueued()[1:]
    assert len(candidates) == 3
    # Candidates are requests of one batch: decoded in the same steps.
    assert any(t.batched_with for t in candidates)


def test_streamed_infill_is_llama_servers_stream(served: Served) -> None:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6, "stream": True}
    with httpx.stream("POST", f"{served.url}/infill", json=body, timeout=NET) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    *pieces, last = events
    assert all(e["stop"] is False for e in pieces)
    assert last["stop"] is True
    assert last["content"] == ""
    assert last["tokens_predicted"] == len(pieces)
    trace = served.recorder.nth(0)
    assert last["tokenbelt"]["trace"]["request_id"] == trace.request_id


def test_openai_sdk_completion_with_a_suffix(served: Served) -> None:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as client:
        done = client.completions.create(
            model="", prompt=PREFIX, suffix=SUFFIX, max_tokens=6, temperature=0.0
        )
        streamed = client.completions.create(
            model="", prompt=PREFIX, suffix=SUFFIX, max_tokens=6, temperature=0.0, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert done.choices[0].text == text  # greedy: the same middle either way
    assert done.choices[0].finish_reason in ("stop", "length")


def test_ollama_client_generate_with_a_suffix(served: Served, fim_gguf: Path) -> None:
    with connect_ollama(served.url) as client:
        reply = client.generate(
            model=fim_gguf.stem, prompt=PREFIX, suffix=SUFFIX, options={"num_predict": 6}
        )
        show = client.show(fim_gguf.stem)
    assert reply.done
    assert reply.done_reason in ("stop", "length")
    assert "insert" in (show.capabilities or [])


# -- a model without FIM tokens ------------------------------------------------------------------


def test_a_model_without_fim_tokens_is_refused_on_every_route(served: Served) -> None:
    lacks = f"model {PLAIN} cannot fill in the middle: its vocabulary has no FIM prefix"
    r = post(served, "/infill", {"model": PLAIN, "input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400
    assert lacks in r.json()["error"]["message"]
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=PLAIN, prompt="a", suffix="b", max_tokens=2)
        assert caught.value.param == "suffix"
        assert lacks in str(caught.value)
        models = {m.id: m for m in client.models.list().data}
    assert models[PLAIN].tokenbelt["fill_in_the_middle"] is False  # type: ignore[attr-defined]
    with connect_ollama(served.url) as ollama_client:
        with pytest.raises(ollama.ResponseError) as refused:
            ollama_client.generate(model=PLAIN, prompt="a", suffix="b")
        capabilities = ollama_client.show(PLAIN).capabilities or []
    assert refused.value.status_code == 400
    assert lacks in refused.value.error
    assert "insert" not in capabilities
    assert served.recorder.events == []  # refused before any compute


@pytest.mark.parametrize(
    ("more", "param"),
    [
        ({"lora": [{"id": 0, "scale": 0.5}]}, "lora"),
        ({"samplers": ["top_k", "warp"]}, "samplers"),
        ({"n_cmpl": 2, "stream": True}, "n_cmpl"),
        ({"n_indent": -1}, "n_indent"),
    ],
)
def test_bad_infill_fields_are_400s_naming_them(
    served: Served, more: dict[str, Any], param: str
) -> None:
    r = post(served, "/infill", {"input_prefix": "a", **more})
    assert r.status_code == 400, r.text
    assert param in json.dumps(r.json()["error"])
    assert served.recorder.events == []


# -- supersede -----------------------------------------------------------------------------------


def burst(served: Served, n: int) -> list[dict[str, Any]]:
    """``n`` completions 50 ms apart with one ``id_slot``, none aborted by its client
    (llama.vim's way), each long enough to be running when the next one comes."""

    async def keystrokes() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=NET) as client:

            async def one(i: int) -> dict[str, Any]:
                body = {"id_slot": 0, "input_prefix": PREFIX + "#" * i, "n_predict": 48}
                body |= {"ignore_eos": True, "temperature": 0.0}
                r = await client.post("/infill", json=body)
                assert r.status_code == 200, r.text
                answer: dict[str, Any] = r.json()
                return answer

            tasks = []
            for i in range(n):
                tasks.append(asyncio.ensure_future(one(i)))
                # A keystroke comes 50 ms after the last one reached the server (on two
                # shared cores, "50 ms apart" alone would not keep them in order).
                while len(served.recorder.enqueued()) <= i:
                    await asyncio.sleep(0.002)
                await asyncio.sleep(0.05)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(keystrokes())


def test_a_burst_of_keystrokes_leaves_only_the_last_running(served: Served) -> None:
    """20 completions 50 ms apart with one ``id_slot``, none aborted by its client: each
    ends ``superseded`` as the next arrives, released before the next one's first token
    (within a step), and only the last runs to its end."""
    answers = burst(served, 20)
    traces = {t.request_id: t for t in served.recorder.enqueued()}
    ordered = [traces[a["tokenbelt"]["trace"]["request_id"]] for a in answers]
    for a in answers[:-1]:
        assert final_reason(a) == "superseded"
        assert a["stop_type"] == "none"
    assert final_reason(answers[-1]) == "length"
    for old, new in itertools.pairwise(ordered):
        assert old.end_reason is EndReason.SUPERSEDED
        assert old.released is not None
        assert old.cancel_requested is not None
        assert new.enqueued is not None
        # Claimed before the newer one was even queued...
        assert old.cancel_requested <= new.enqueued
        # ...and let go before the newer one's first token: within a step.
        if new.first_token is not None:
            assert old.released <= new.first_token
    assert served.model().statistics().queue_peak <= 4


def sample(metrics: str, name: str, model: str) -> float:
    """The value of ``name`` for ``model`` on ``/infill`` (0 while the series is absent)."""
    labels = f'{{api="llamacpp",model="{model}"}}'
    line = next((x for x in metrics.splitlines() if x.startswith(name + labels)), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def test_stale_completions_show_in_metrics_health_and_ps(served: Served, fim_gguf: Path) -> None:
    """A burst of keystrokes on one ``id_slot``: ``/metrics`` counts the superseded
    requests, the tokens computed for them after their stop (at most the step in flight
    at the stop) and each completion's first token; ``/health`` and ``tokenbelt ps`` say
    the same of the model."""
    name, n = fim_gguf.stem, 6
    series = (
        "tokenbelt_superseded_requests_total",
        "tokenbelt_stale_tokens_total",
        "tokenbelt_completion_first_token_seconds_count",
    )

    def seen() -> tuple[list[float], dict[str, Any]]:
        metrics = plainhttp.get(f"{served.url}/metrics", timeout=NET).text
        health = plainhttp.get(f"{served.url}/health", timeout=NET).json()
        return [sample(metrics, s, name) for s in series], health["model_status"][name]

    (superseded, stale, firsts), status = seen()
    before = status["completions"]
    burst(served, n)
    traces = served.recorder.enqueued()
    assert len(traces) == n
    old = traces[:-1]
    assert all(t.end_reason is EndReason.SUPERSEDED and t.infill for t in old)
    for t in old:  # the step in flight at the stop: its prompt chunk, or one token
        assert t.tokens_after_stop <= max(t.prompt_tokens, 1)
    after_stop = sum(t.tokens_after_stop for t in old)
    with_first = [t for t in traces if t.first_token is not None]
    (superseded_now, stale_now, firsts_now), status = seen()
    assert superseded_now - superseded == n - 1
    assert stale_now - stale == after_stop
    assert firsts_now - firsts == len(with_first)
    now = status["completions"]
    assert now["completions"] - before["completions"] == n
    assert now["superseded"] - before["superseded"] == n - 1
    assert now["stale_tokens"] - before["stale_tokens"] == after_stop
    assert 0 < now["first_token_p50_ms"] <= now["first_token_p95_ms"]
    health = plainhttp.get(f"{served.url}/health", timeout=NET).json()
    shown = table(health, [])
    assert (
        f"completions on {name}: {now['completions']} served, {now['superseded']} "
        f"superseded, {now['stale_tokens']} stale tokens; keystroke to first token p50 "
    ) in shown
    assert f"completions on {PLAIN}:" not in shown  # it served none


def test_supersede_by_header_and_by_option_on_v1_completions(served: Served) -> None:
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 400, "ignore_eos": True}
    headers = {"X-Tokenbelt-Supersede": "editor-1"}
    url = f"{served.url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        newer = {**body, "max_tokens": 2, "tokenbelt": {"supersede": "editor-1"}}
        assert post(served, "/v1/completions", newer).status_code == 200
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    final = [c for c in rest if c.get("tokenbelt")][-1]
    assert final["tokenbelt"]["end_reason"] == "superseded"
    assert final["choices"][0]["finish_reason"] == "stop"
    served.assert_released(served.recorder.nth(0), EndReason.SUPERSEDED)


def test_continue_aborts_every_keystroke(served: Served) -> None:
    """Continue aborts the previous request at each keystroke: the disconnect ends it."""
    url = f"{served.url}/v1/completions"
    for i in range(3):
        body = {"prompt": PREFIX + "x" * i, "suffix": SUFFIX, "max_tokens": 400}
        body |= {"ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=NET) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
        served.assert_released(served.recorder.nth(i), EndReason.CLIENT_DISCONNECT)


# -- deadlines -----------------------------------------------------------------------------------


def test_t_max_prompt_ms_ends_a_long_prefill(served: Served) -> None:
    body = {"input_prefix": LONG_PROMPT, "n_predict": 8, "cache_prompt": False}
    answer = post(served, "/infill", {**body, "t_max_prompt_ms": 20}).json()
    assert final_reason(answer) == "first_token_timeout"
    assert answer["content"] == ""
    assert answer["stop_type"] == "limit"
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason.FIRST_TOKEN_TIMEOUT)
    assert trace.first_token is None  # ended inside the prefill
    assert trace.prompt_tokens > 1000


def test_t_max_predict_ms_ends_at_the_first_newline_after_it(served: Served) -> None:
    body = {"input_prefix": "1\n2\n3\n4\n5\n", "n_predict": 64, "ignore_eos": True}
    body |= {"temperature": 0.0, "t_max_predict_ms": 1}
    answer = post(served, "/infill", body).json()
    assert final_reason(answer) == "total_timeout"
    assert answer["tokenbelt"]["line_rule"] == "time"
    assert answer["stop_type"] == "limit"
    assert answer["content"].endswith("\n")
    assert answer["tokens_predicted"] < 64
