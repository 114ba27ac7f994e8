"""The remote engine in front of llama.cpp's own ``llama-server`` (the llama.cpp that
tokenbelt runs, serving the embedded model with two slots): the probe names it, what it
takes passes through, and its ``/slots`` is the evidence that a stop at the front reached
it; the front's trace says so itself (``upstream.release``, ``release_by == "slots"``).

Marked ``llama_server``: run with ``TOKENBELT_LLAMA_SERVER=PATH`` or
``TOKENBELT_LLAMA_SERVER_BUILD=1`` (``llama_server_fixture.py``).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest

import plainhttp
from engines.remote.llama_server_fixture import MODEL, llama_server_process
from engines.remote.processes import running
from engines.remote.real import (
    COUNT,
    Real,
    assert_schema_and_named_call,
    cancel_then_deadline,
    chat_body,
    front,
    leave_a_stream,
    leave_unstreamed,
)
from server.conftest import CHAT, NET, ServeFactory, collect
from tokenbelt import InvalidArgument

# A build on first use (with TOKENBELT_LLAMA_SERVER_BUILD=1) takes minutes, once.
pytestmark = [pytest.mark.llama_server, pytest.mark.timeout(1800)]

body = partial(chat_body, MODEL)


def slots(url: str) -> list[dict[str, Any]]:
    """llama-server's own account of its slots (``/slots``)."""
    listed: list[dict[str, Any]] = plainhttp.get(f"{url}/slots", timeout=NET).json()
    return listed


def busy(url: str) -> int:
    """llama-server's slots at work."""
    return sum(1 for slot in slots(url) if slot["is_processing"])


def last_params(url: str) -> dict[str, Any]:
    """The sampling parameters of the request llama-server took last (its highest task id)."""
    latest = max((s for s in slots(url) if "id_task" in s), key=lambda s: s["id_task"])
    params: dict[str, Any] = latest["params"]
    return params


def real(url: str) -> Real:
    return Real(url, MODEL, "llama-server", "slots", busy)


def test_stream_and_json_through_the_front(llama_server: str, serve: ServeFactory) -> None:
    fr = front(serve, llama_server)
    streamed = body(max_tokens=8, stream=True, stream_options={"include_usage": True})
    with plainhttp.stream("POST", fr.url + CHAT, json=streamed, timeout=NET) as response:
        assert response.status_code == 200
        events = collect(response.iter_lines())
    assert events[-1] == "[DONE]"
    text = "".join(
        (e["choices"][0]["delta"].get("content") or "") for e in events[:-1] if e.get("choices")
    )
    assert text
    (usage,) = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert 0 < usage["completion_tokens"] <= 8
    assert usage["prompt_tokens"] > 0
    ends = [e["tokenbelt"].get("end_reason") for e in events[:-1] if "tokenbelt" in e]
    assert ends[-1] in ("stop", "length")
    trace = fr.recorder.nth(0)
    fr.recorder.wait(trace, "released")
    assert trace.upstream is not None
    assert trace.upstream["kind"] == "llama-server"
    assert trace.upstream["release"] == "finished"
    answer = plainhttp.post(fr.url + CHAT, json=body(max_tokens=8), timeout=NET)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] > 0
    upstream = reply["tokenbelt"]["trace"]["upstream"]
    assert upstream["kind"] == "llama-server"
    # Its build (llama.cpp's number and commit) is its version.
    props = plainhttp.get(f"{llama_server}/props", timeout=NET).json()
    assert upstream.get("version") == props["build_info"], upstream
    assert upstream["request_id"].startswith("chatcmpl-")
    assert upstream["release"] == "finished"


def test_what_llama_server_takes_passes_through_and_the_rest_is_refused(
    llama_server: str, serve: ServeFactory
) -> None:
    fr = front(serve, llama_server)
    answer = plainhttp.post(fr.url + CHAT, json=body(max_tokens=20, ignore_eos=True), timeout=NET)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert reply["usage"]["completion_tokens"] == 20, reply
    assert reply["choices"][0]["finish_reason"] == "length"
    assert last_params(llama_server)["ignore_eos"] is True
    # The SDK's options beyond OpenAI's (the HTTP route takes only OpenAI's and ignore_eos).
    options = {"top_k": 7, "min_p": 0.07, "repeat_penalty": 1.2, "repeat_last_n": 8}
    reply = fr.model().complete([{"role": "user", "content": "hi"}], max_tokens=4, **options)
    assert reply.usage.completion_tokens > 0
    taken = last_params(llama_server)
    assert {name: taken[name] for name in options} == pytest.approx(options)
    with pytest.raises(InvalidArgument, match="min_tokens") as refused:
        fr.model().complete([{"role": "user", "content": "hi"}], max_tokens=2, min_tokens=2)
    assert f"upstream {llama_server} (llama-server)" in str(refused.value)


def test_json_schema_and_tools_reach_llama_server_as_its_grammar(
    llama_server: str, serve: ServeFactory
) -> None:
    fr = front(serve, llama_server)
    # Greedy, with room to end: a sampled name may run past a short limit, cut mid-string.
    assert_schema_and_named_call(fr.url, MODEL, max_tokens=200, temperature=0.0)


def test_a_client_that_leaves_a_stream_is_released_at_llama_server(
    llama_server: str, serve: ServeFactory
) -> None:
    leave_a_stream(front(serve, llama_server), real(llama_server))


def test_a_non_streaming_client_that_leaves_is_released_at_llama_server(
    llama_server: str, serve: ServeFactory
) -> None:
    leave_unstreamed(front(serve, llama_server), real(llama_server))


def test_a_user_cancel_and_a_deadline_are_released_at_llama_server(
    llama_server: str, serve: ServeFactory
) -> None:
    cancel_then_deadline(front(serve, llama_server), real(llama_server))


def test_a_stop_is_confirmed_while_the_other_slot_is_at_work(
    llama_server: str, serve: ServeFactory
) -> None:
    fr = front(serve, llama_server)
    (model,) = fr.runtime.models.values()
    kept = model.stream([{"role": "user", "content": COUNT}], max_tokens=1500, ignore_eos=True)
    stopped = model.stream([{"role": "user", "content": COUNT}], max_tokens=1500, ignore_eos=True)
    # Held: an iterator dropped part way closes its stream, which stops the request.
    pieces = iter(kept), iter(stopped)
    for each in pieces:
        next(each)
    assert busy(llama_server) == 2
    stopped.cancel()
    assert stopped.wait_released(NET)
    upstream = stopped.trace.upstream
    assert upstream is not None
    # One slot still at work, and it is the front's other request's: the count fell to it.
    assert upstream["release"] == "confirmed", upstream.get("release_why")
    assert upstream["release_by"] == "slots"
    assert busy(llama_server) == 1
    kept.cancel()
    assert kept.wait_released(NET)
    assert kept.trace.upstream is not None
    assert kept.trace.upstream["release"] == "confirmed", kept.trace.upstream.get("release_why")
    assert busy(llama_server) == 0


def test_without_slots_a_stop_is_not_claimed(
    llama_server_binary: Path, serve: ServeFactory, tmp_path: Path
) -> None:
    server = llama_server_process(tmp_path, llama_server_binary, slots=False)
    with running(server):
        fr = front(serve, server.url)
        (model,) = fr.runtime.models.values()
        stream = model.stream([{"role": "user", "content": COUNT}], max_tokens=1500)
        pieces = iter(stream)
        next(pieces)
        stream.cancel()
        assert stream.wait_released(NET)
        upstream = stream.trace.upstream
        assert upstream is not None
        assert upstream["kind"] == "llama-server"
        assert upstream["release"] == "unconfirmed"
        assert "--no-slots" in upstream["release_why"]
