"""The remote engine in front of a real vLLM (the CPU build, the embedded model's weights
in bf16): what runs against tokenbelt and llama.cpp's servers elsewhere, here against the
engine a growing team moves to. vLLM's own ``/metrics`` is the evidence that a stop at
the front reached it; the front's trace says so itself (``upstream.release``).

Marked ``vllm``: run with ``TOKENBELT_VLLM=1`` (``vllm_fixture.py``). The last test kills
the session's spare vLLM.
"""

from __future__ import annotations

import time
from functools import partial

import pytest

import plainhttp
from engines.remote import vllm_cpu
from engines.remote.real import (
    COUNT,
    WEATHER,
    Real,
    assert_schema_and_named_call,
    cancel_then_deadline,
    chat_body,
    front,
    leave_a_stream,
    leave_unstreamed,
)
from engines.remote.vllm_fixture import Vllms
from server.conftest import CHAT, NET, ServeFactory, collect
from tokenbelt import EndReason, InvalidArgument, UpstreamUnavailable
from tokenbelt.engines.remote._kinds import metric

# The fixture's first use makes the venv (minutes, once) and starts two vLLMs.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

body = partial(chat_body, vllm_cpu.MODEL)


def busy(url: str) -> float:
    """vLLM's requests running and waiting, from its own ``/metrics``."""
    text = plainhttp.get(f"{url}/metrics", timeout=NET).text
    return (metric(text, "vllm:num_requests_running") or 0) + (
        metric(text, "vllm:num_requests_waiting") or 0
    )


def real(url: str) -> Real:
    return Real(url, vllm_cpu.MODEL, "vllm", "metrics", busy)


def test_stream_and_json_through_the_front(vllms: Vllms, serve: ServeFactory) -> None:
    fr = front(serve, vllms.main)
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
    answer = plainhttp.post(fr.url + CHAT, json=body(max_tokens=8), timeout=NET)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert reply["choices"][0]["message"]["content"]
    upstream = reply["tokenbelt"]["trace"]["upstream"]
    assert (upstream["kind"], upstream["version"]) == ("vllm", vllm_cpu.VERSION)
    # vLLM took the front's request id into its own.
    assert upstream["request_id"] == "chatcmpl-" + answer.headers["x-request-id"]
    assert upstream["release"] == "finished"


def test_what_vllm_takes_passes_through_and_the_rest_is_refused(
    vllms: Vllms, serve: ServeFactory
) -> None:
    fr = front(serve, vllms.main)
    for extra in ({"ignore_eos": True}, {"min_tokens": 20}):
        answer = plainhttp.post(fr.url + CHAT, json=body(max_tokens=20, **extra), timeout=NET)
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        assert reply["usage"]["completion_tokens"] == 20, (extra, reply)
        assert reply["choices"][0]["finish_reason"] == "length"
    # What the front cannot relay, and what vLLM does not take: one line naming it.
    answer = plainhttp.post(fr.url + CHAT, json=body(logprobs=True), timeout=NET)
    assert answer.status_code == 400
    assert "logprobs is not supported by the remote engine" in answer.text
    with pytest.raises(InvalidArgument, match="repeat_last_n") as refused:
        fr.model().complete([{"role": "user", "content": "hi"}], max_tokens=2, repeat_last_n=8)
    assert f"upstream {vllms.main} (vllm)" in str(refused.value)


def test_json_schema_and_tools_reach_vllm_as_its_grammar(vllms: Vllms, serve: ServeFactory) -> None:
    fr = front(serve, vllms.main)
    assert_schema_and_named_call(fr.url, vllm_cpu.MODEL, max_tokens=60)
    # A grammar that starts at a trigger (the model chooses): vLLM has no such thing.
    asked = body("Weather in Paris?", max_tokens=60, tools=[WEATHER], tool_choice="auto")
    answer = plainhttp.post(fr.url + CHAT, json=asked, timeout=NET)
    assert answer.status_code == 400
    assert "tool_choice" in answer.text


def test_a_4xx_from_vllm_passes_through(vllms: Vllms, serve: ServeFactory) -> None:
    fr = front(serve, vllms.main)
    out_of_vocabulary = body(max_tokens=4, logit_bias={"999999": 5})
    answer = plainhttp.post(fr.url + CHAT, json=out_of_vocabulary, timeout=NET)
    assert answer.status_code == 400
    assert "out-of-vocab" in answer.json()["error"]["message"]
    streamed = {**out_of_vocabulary, "stream": True}
    with plainhttp.stream("POST", fr.url + CHAT, json=streamed, timeout=NET) as response:
        events = collect(response.iter_lines())
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert errors, events
    assert "out-of-vocab" in errors[-1]["message"]


def test_a_client_that_leaves_a_stream_is_released_at_vllm(
    vllms: Vllms, serve: ServeFactory
) -> None:
    leave_a_stream(front(serve, vllms.main), real(vllms.main))


def test_a_non_streaming_client_that_leaves_is_released_at_vllm(
    vllms: Vllms, serve: ServeFactory
) -> None:
    leave_unstreamed(front(serve, vllms.main), real(vllms.main))


def test_a_user_cancel_and_a_deadline_are_released_at_vllm(
    vllms: Vllms, serve: ServeFactory
) -> None:
    cancel_then_deadline(front(serve, vllms.main), real(vllms.main))


def test_two_vllms_behind_one_model(vllms: Vllms, serve: ServeFactory) -> None:
    spare = vllms.spare().url
    fr = front(serve, vllms.main, spare)
    (model,) = fr.runtime.models.values()
    first = model.stream([{"role": "user", "content": COUNT}], max_tokens=1500, ignore_eos=True)
    second = model.stream([{"role": "user", "content": COUNT}], max_tokens=1500, ignore_eos=True)
    next(iter(first))
    next(iter(second))
    # Least outstanding requests: one on each.
    assert first.trace.upstream is not None
    assert second.trace.upstream is not None
    assert {first.trace.upstream["url"], second.trace.upstream["url"]} == {vllms.main, spare}
    # Both stopped at once: two CPU vLLMs on 2 cores spin for each other's cores, and one
    # left decoding could starve the other's abort past the front's wait for it.
    for stream in (first, second):
        stream.cancel()
    for stream in (first, second):
        assert stream.wait_released(NET)
        upstream = stream.trace.upstream
        assert upstream is not None
        assert upstream["release"] == "confirmed", upstream.get("release_why")
    # The spare serves its abort route (--enable-scale-out): the front called it too.
    on_spare = first if first.trace.upstream["url"] == spare else second
    assert on_spare.trace.upstream is not None
    expected = f"200 for chatcmpl-{on_spare.trace.request_id}"
    assert on_spare.trace.upstream["abort"] == expected
    assert busy(vllms.main) == busy(spare) == 0


def test_a_vllm_killed_mid_stream_ends_the_request_with_its_cause(
    vllms: Vllms, serve: ServeFactory
) -> None:
    spare = vllms.spare()
    fr = front(serve, spare.url)
    (model,) = fr.runtime.models.values()
    stream = model.stream([{"role": "user", "content": COUNT}], max_tokens=1500, ignore_eos=True)
    pieces = iter(stream)
    next(pieces)
    spare.kill()
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable, match=r"broke off|closed the stream") as failed:
        for _ in pieces:
            pass
    assert spare.url in str(failed.value)
    assert stream.end_reason is EndReason.RUNTIME_ERROR
    assert stream.trace.upstream is not None
    assert stream.trace.upstream["release"] == "upstream_ended"
    # Not a timing target: the end reaches the reader, not a hang until some deadline.
    assert time.monotonic() - started < NET
