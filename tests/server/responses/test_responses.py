"""``/v1/responses`` over scripted engines: the object, the events, the store, cancel.

The real model and real agent clients are in ``test_responses_clients.py``; here the
shapes, the ends and the bounds are checked exactly, fast.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import plainhttp
from tokenbelt import EndReason, GenerationRequest, ScriptedEngine
from tokenbelt.belt import Producer
from tokenbelt.server import ServerSettings

from ..conftest import NET, Served, ServeFactory, eventually, scripted_runtime, words

SCRIPT = words(6)
TEXT = "".join(SCRIPT)
STORE = ServerSettings(responses_store_bytes=1 << 20)
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


class Recording(ScriptedEngine):
    """A scripted engine that keeps the messages of every request it was given."""

    def __init__(self, tokens: list[str], **kwargs: Any) -> None:
        super().__init__(tokens, **kwargs)
        self.seen: list[Any] = []

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        self.seen.append(request.messages)
        return super().generate(request, producer)


def _runtime(engine: ScriptedEngine | None = None) -> Any:
    runtime = scripted_runtime(engine or Recording(SCRIPT, delay=0), slots=1)
    runtime.add_engines("endless", [ScriptedEngine(words(100_000), delay=0.002)])
    return runtime


@pytest.fixture
def stateless(serve: ServeFactory) -> Served:
    return serve(_runtime())


@pytest.fixture
def stored(serve: ServeFactory) -> Served:
    return serve(_runtime(), STORE)


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET, max_retries=0)


@pytest.fixture
def client(stateless: Served) -> Iterator[openai.OpenAI]:
    with _client(stateless) as c:
        yield c


def _events(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every event of a streamed response, read with plain httpx (event: and data:)."""
    events = []
    with plainhttp.stream(
        "POST", f"{served.url}/v1/responses", json={**body, "stream": True}, timeout=NET
    ) as r:
        assert r.status_code == 200, r.read()
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == kind
                events.append(event)
    return events


def _post(served: Served, body: dict[str, Any]) -> httpx.Response:
    return plainhttp.post(f"{served.url}/v1/responses", json=body, timeout=NET)


# -- the object and its events ---------------------------------------------------------------


def test_create_answers_a_response_object(client: openai.OpenAI) -> None:
    reply = client.responses.create(model="scripted", input="hi", instructions="Be brief.")
    assert reply.id.startswith("resp_")
    assert reply.object == "response"
    assert reply.status == "completed"
    assert reply.output_text == TEXT
    [item] = reply.output
    assert item.type == "message"
    assert item.status == "completed"
    assert reply.instructions == "Be brief."
    assert reply.store is False
    assert reply.usage is not None
    assert reply.usage.output_tokens == len(SCRIPT)
    assert reply.usage.total_tokens == reply.usage.input_tokens + len(SCRIPT)
    extension = reply.model_extra["tokenbelt"]  # type: ignore[index]
    assert extension["end_reason"] == "stop"
    assert extension["trace"]["request_id"] == "req_" + reply.id.removeprefix("resp_")


def test_max_output_tokens_is_incomplete_with_its_reason(client: openai.OpenAI) -> None:
    reply = client.responses.create(model="scripted", input="hi", max_output_tokens=2)
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text == "".join(SCRIPT[:2])
    assert reply.output[0].status == "incomplete"
    assert reply.model_extra["tokenbelt"]["end_reason"] == "length"  # type: ignore[index]


def test_the_stream_is_the_full_event_sequence(stateless: Served) -> None:
    events = _events(stateless, {"model": "scripted", "input": "hi"})
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(SCRIPT),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"].endswith("text.delta")) == TEXT
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == TEXT
    assert final["tokenbelt"]["end_reason"] == "stop"
    assert events[0]["response"]["status"] == "in_progress"


def test_the_sdk_stream_helper_reads_it(client: openai.OpenAI) -> None:
    with client.responses.stream(model="scripted", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == TEXT == final.output_text


def test_a_deadline_still_sends_one_terminal_event(stateless: Served) -> None:
    body = {"model": "endless", "input": "hi", "tokenbelt": {"total_timeout": 0.2}}
    events = _events(stateless, body)
    assert [e["type"] for e in events].count("response.failed") == 1
    assert events[-1]["type"] == "response.failed"
    final = events[-1]["response"]
    assert final["status"] == "failed"
    assert final["error"]["code"] == "total_timeout"
    assert final["tokenbelt"]["end_reason"] == "total_timeout"
    assert not any(e["type"] in TERMINAL for e in events[:-1])


def test_an_engine_failure_is_response_failed(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(SCRIPT, delay=0, fail_after=2)))
    events = _events(served, {"input": "hi"})
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "runtime_error"
    assert events[-1]["response"]["tokenbelt"]["end_reason"] == "runtime_error"


# -- stateless, and honest about it ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "extra"),
    [
        ("previous_response_id", {"previous_response_id": "resp_x"}),
        ("store", {"store": True}),
        ("background", {"background": True}),
    ],
)
def test_without_a_store_state_is_a_clear_400(
    stateless: Served, field: str, extra: dict[str, Any]
) -> None:
    r = _post(stateless, {"input": "hi", **extra})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field
    assert "--responses-store" in error["message"]
    assert stateless.recorder.enqueued() == []


def test_health_says_the_server_is_stateless(stateless: Served) -> None:
    body = plainhttp.get(f"{stateless.url}/health", timeout=NET).json()
    assert body["responses_store"]["enabled"] is False


def test_retrieve_without_a_store_says_why(client: openai.OpenAI) -> None:
    reply = client.responses.create(model="scripted", input="hi")
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(reply.id)
    assert "keeps no responses" in str(caught.value)


# -- the store -------------------------------------------------------------------------------


def test_previous_response_id_rebuilds_the_conversation(stored: Served) -> None:
    engine = stored.model("scripted").engines[0]  # type: ignore[attr-defined]
    with _client(stored) as c:
        first = c.responses.create(model="scripted", input="my name is Ada", instructions="A")
        second = c.responses.create(
            model="scripted", input="what is my name?", previous_response_id=first.id
        )
        assert second.previous_response_id == first.id
        # The instructions of the first response are not carried over (as OpenAI does).
        assert [(m["role"], m["content"]) for m in engine.seen[-1]] == [
            ("user", "my name is Ada"),
            ("assistant", TEXT),
            ("user", "what is my name?"),
        ]
        assert c.responses.retrieve(first.id).output_text == TEXT
        items = c.responses.input_items.list(second.id)
        assert [i.type for i in items.data] == ["message"]
        assert items.data[0].content[0].text == "what is my name?"  # type: ignore[union-attr]
        c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError, match="deleted"):
            c.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as caught:
            c.responses.create(model="scripted", input="again", previous_response_id=second.id)
        assert caught.value.body["message"] == (  # type: ignore[index]
            f"response {second.id!r} cannot be continued: an earlier response of its "
            f"conversation, {first.id!r}, is gone (it was deleted)"
        )
        assert caught.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError, match="never stored"):
            c.responses.retrieve("resp_nope")


def test_store_false_keeps_nothing(stored: Served) -> None:
    with _client(stored) as c:
        reply = c.responses.create(model="scripted", input="hi", store=False)
        assert reply.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(reply.id)


def test_the_store_is_in_metrics(stored: Served) -> None:
    with _client(stored) as c:
        c.responses.create(model="scripted", input="hi")
    text = plainhttp.get(f"{stored.url}/metrics", timeout=NET).text
    assert "tokenbelt_responses_stored 1.0" in text
    assert "tokenbelt_responses_store_budget_bytes 1.048576e+06" in text


# -- cancel, for any response ----------------------------------------------------------------


def _cancel(served: Served, response_id: str) -> dict[str, Any]:
    r = plainhttp.post(f"{served.url}/v1/responses/{response_id}/cancel", timeout=NET)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_cancel_a_streamed_response(stateless: Served) -> None:
    events: list[dict[str, Any]] = []
    with plainhttp.stream(
        "POST",
        f"{stateless.url}/v1/responses",
        json={"model": "endless", "input": "hi", "stream": True},
        timeout=NET,
    ) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta":
                    break
        answer = _cancel(stateless, events[0]["response"]["id"])
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    trace = stateless.recorder.nth(0)
    stateless.assert_released(trace, EndReason.USER_CANCEL)
    assert answer["status"] == "cancelled"
    assert answer["tokenbelt"]["end_reason"] == "user_cancel"
    terminal = [e for e in events if e["type"] in TERMINAL]
    assert terminal == [events[-1]]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "cancelled"


def test_cancel_a_blocking_response(stateless: Served) -> None:
    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(_post(stateless, {"model": "endless", "input": "hi"}))
    )
    thread.start()
    trace = stateless.recorder.nth(0)
    stateless.recorder.wait(trace, "first_token")
    answer = _cancel(stateless, "resp_" + trace.request_id.removeprefix("req_"))
    thread.join(NET)
    stateless.assert_released(trace, EndReason.USER_CANCEL)
    assert answer["status"] == "cancelled"
    [reply] = answers
    assert reply.status_code == 200
    assert reply.json()["status"] == "cancelled"
    assert reply.json()["output"][0]["status"] == "incomplete"


def test_cancel_of_an_unknown_response_is_a_404(stateless: Served) -> None:
    r = plainhttp.post(f"{stateless.url}/v1/responses/resp_nope/cancel", timeout=NET)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "response_not_found"


# -- background ------------------------------------------------------------------------------


def test_background_runs_detached_and_resumes(stored: Served) -> None:
    r = _post(stored, {"model": "scripted", "input": "hi", "background": True})
    assert r.status_code == 200
    started = r.json()
    assert started["status"] == "in_progress"
    assert started["background"] is True
    trace = stored.recorder.nth(0)
    stored.assert_released(trace, EndReason.STOP)
    url = f"{stored.url}/v1/responses/{started['id']}"
    with plainhttp.stream(
        "GET", url, params={"stream": "true", "starting_after": 2}, timeout=NET
    ) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert events[0]["sequence_number"] == 3
    assert events[-1]["type"] == "response.completed"
    assert plainhttp.get(url, timeout=NET).json()["status"] == "completed"


def test_a_streamed_background_response_streams_and_outlives_its_reader(
    stored: Served,
) -> None:
    """``stream`` with ``background``: the events as they come (the openai client reads
    them), and a reader that leaves stops nothing: the rest is there to resume."""
    client = openai.OpenAI(base_url=f"{stored.url}/v1", api_key="unused", max_retries=0)
    with client.responses.create(
        model="endless", input="hi", stream=True, background=True, max_output_tokens=40
    ) as events:
        first = [event for _, event in zip(range(4), events, strict=False)]
    assert [e.type for e in first[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in first] == [0, 1, 2, 3]
    response_id = first[0].response.id
    trace = stored.recorder.nth(0)
    stored.assert_released(trace, EndReason.LENGTH)  # ran on after the reader left
    assert trace.completion_tokens == 40
    rest = list(
        client.responses.retrieve(response_id, stream=True, starting_after=3)  # type: ignore[call-overload]
    )
    assert rest[0].sequence_number == 4
    assert rest[-1].type == "response.incomplete"
    assert rest[-1].response.incomplete_details.reason == "max_output_tokens"


def test_cancel_a_background_response(stored: Served) -> None:
    started = _post(stored, {"model": "endless", "input": "hi", "background": True}).json()
    trace = stored.recorder.nth(0)
    stored.recorder.wait(trace, "first_token")
    answer = _cancel(stored, started["id"])
    stored.assert_released(trace, EndReason.USER_CANCEL)
    assert answer["status"] == "cancelled"
    kept = plainhttp.get(f"{stored.url}/v1/responses/{started['id']}", timeout=NET).json()
    assert kept["status"] == "cancelled"
    assert kept["tokenbelt"]["end_reason"] == "user_cancel"


def _kept(served: Served, response_id: str) -> dict[str, Any]:
    """The stored response, once the server has handled its reader's leaving (just after
    the release: a bounded poll)."""
    url = f"{served.url}/v1/responses/{response_id}"
    answers: list[httpx.Response] = []

    def stored() -> bool:
        answers.append(plainhttp.get(url, timeout=NET))
        return answers[-1].status_code == 200 and answers[-1].json()["status"] != "in_progress"

    eventually(stored, f"{response_id} stored")
    body: dict[str, Any] = answers[-1].json()
    return body


def _goes_on_from(served: Served, response_id: str) -> None:
    r = _post(served, {"model": "scripted", "input": "go on", "previous_response_id": response_id})
    assert r.status_code == 200, r.text
    assert r.json()["previous_response_id"] == response_id


def test_a_streamed_response_whose_reader_left_is_kept_cancelled(stored: Served) -> None:
    """A client that closes the stream (a Stop button): the response is stored as it
    stood, ``cancelled``, and the conversation goes on from it."""
    with plainhttp.stream(
        "POST",
        f"{stored.url}/v1/responses",
        json={"model": "endless", "input": "hi", "stream": True},
        timeout=NET,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.created":
                response_id = event["response"]["id"]
            if event["type"] == "response.output_text.delta":
                break
    stored.assert_released(stored.recorder.nth(0), EndReason.CLIENT_DISCONNECT)
    kept = _kept(stored, response_id)
    assert kept["status"] == "cancelled"
    assert kept["tokenbelt"]["end_reason"] == "client_disconnect"
    assert kept["output"][0]["status"] == "incomplete"
    assert kept["output"][0]["content"][0]["text"].startswith(TEXT[:2])
    _goes_on_from(stored, response_id)


def test_a_blocking_response_whose_client_gave_up_is_kept_cancelled(stored: Served) -> None:
    with pytest.raises(httpx.ReadTimeout):
        plainhttp.post(
            f"{stored.url}/v1/responses", json={"model": "endless", "input": "hi"}, timeout=0.3
        )
    trace = stored.recorder.nth(0)
    stored.assert_released(trace, EndReason.CLIENT_DISCONNECT)
    kept = _kept(stored, "resp_" + trace.request_id.removeprefix("req_"))
    assert kept["status"] == "cancelled"
    assert kept["output"][0]["content"][0]["text"]  # what was made before the client left
    assert kept["usage"]["output_tokens"] == trace.completion_tokens
    _goes_on_from(stored, kept["id"])


# -- bad input and missing routes ------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "temperatur": 1}, "temperatur"),
        ({"input": [{"type": "web_search_call", "status": "completed"}]}, "input.0.type"),
        (
            {"input": [{"type": "function_call_output", "output": "done"}]},
            "input.0.call_id",
        ),
        (
            {"input": [{"type": "function_call_output", "name": "f", "output": "done"}]},
            "input.0.name",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.function_call.call_id"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
        ),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include.0"),
    ],
)
def test_bad_input_is_a_400_naming_it(stateless: Served, body: dict[str, Any], param: str) -> None:
    r = _post(stateless, {"model": "scripted", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert stateless.recorder.enqueued() == []


def _file(data: bytes, media: str, name: str = "notes.txt") -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "input_file", "filename": name, "file_data": f"data:{media};base64,{encoded}"}


def test_a_text_file_is_read_as_text(stateless: Served) -> None:
    engine = stateless.model("scripted").engines[0]  # type: ignore[attr-defined]
    asked = {"type": "input_text", "text": "Summarize it."}
    for media in ("text/plain", "application/json", ""):  # "": known by its name
        content = [asked, _file(b"milk, eggs\nbread", media)]
        body = {"model": "scripted", "input": [{"role": "user", "content": content}]}
        assert _post(stateless, body).status_code == 200
        assert engine.seen[-1][-1]["content"] == "Summarize it.\nnotes.txt:\nmilk, eggs\nbread"


@pytest.mark.parametrize(
    ("part", "says"),
    [
        (_file(b"%PDF-1.4", "application/pdf", "a.pdf"), "'application/pdf'"),
        (_file(b"\xff\xfe", "text/plain"), "not base64 UTF-8 text"),
        ({"type": "input_file", "file_id": "file-1"}, "no Files API"),
        ({"type": "input_file", "file_data": "aGk="}, "a base64 data: URL"),
    ],
)
def test_a_file_that_is_not_text_is_a_400_saying_why(
    stateless: Served, part: dict[str, Any], says: str
) -> None:
    body = {"model": "scripted", "input": [{"role": "user", "content": [part]}]}
    r = _post(stateless, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("input.0.content.0"), error
    assert says in error["message"], error
    assert stateless.recorder.enqueued() == []


def test_a_verbosity_level_says_what_bounds_a_reply_instead(stateless: Served) -> None:
    r = _post(stateless, {"model": "scripted", "input": "hi", "text": {"verbosity": "low"}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "text.verbosity"
    assert "no verbosity levels" in error["message"]
    assert "max_output_tokens" in error["message"]
    medium = {"model": "scripted", "input": "hi", "text": {"verbosity": "medium"}}
    assert _post(stateless, medium).is_success


def test_top_logprobs_says_where_log_probabilities_are(stateless: Served) -> None:
    r = _post(stateless, {"model": "scripted", "input": "hi", "top_logprobs": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "top_logprobs"
    assert "no log probabilities on /v1/responses" in error["message"]
    assert "Value error" not in error["message"]
    assert "0 to 20" not in error["message"]
    assert _post(stateless, {"model": "scripted", "input": "hi", "top_logprobs": 0}).is_success


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/images/generations", 501),
        ("POST", "/v1/audio/speech", 501),
        ("POST", "/v1/messages/batches", 501),
        ("POST", "/api/create", 501),
        ("POST", "/api/copy", 501),
        ("POST", "/v2/embed", 501),
        ("GET", "/v1/nothing-here", 404),
    ],
)
def test_a_route_that_is_not_here_says_so(
    stateless: Served, method: str, path: str, status: int
) -> None:
    r = plainhttp.request(method, f"{stateless.url}{path}", json={}, timeout=NET)
    assert r.status_code == status
    # the SDKs retry a 5xx unless told not to; a missing route does not come back
    assert r.headers.get("x-should-retry") == ("false" if status == 501 else None)
    body = r.json()
    # Ollama's shape on Ollama's routes: the error is the message
    message = body["error"] if path.startswith("/api/") else body["error"]["message"]
    assert f"{method} {path}" in message
    assert "/v1/responses" in message
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"  # Anthropic's shape on Anthropic's routes
