"""The official ``ollama`` client, unchanged, against the real default model: chat, generate,
stops, durations from the trace, keep_alive, tool calls, and leaving early
(``client_disconnect``)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest

import plainhttp
from tokenbelt import EndReason, ModelState

from ..conftest import (
    LONG_PROMPT,
    NET,
    Served,
    SharedServer,
    connect_ollama,
    eventually,
    real_runtime,
    shared_server,
)

pytestmark = pytest.mark.model

SEA = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0.0, "seed": 1}


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    """One server for the module's tests that only send requests and read their traces."""
    with shared_server(real_runtime) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[ollama.Client]:
    with connect_ollama(served.url) as c:
        yield c


def name(served: Served) -> str:
    return served.model().name


def record(served: Served, request_id: str) -> dict[str, object]:
    body: dict[str, object] = plainhttp.get(
        f"{served.url}/v1/requests/{request_id}", timeout=NET
    ).json()
    return body


def test_chat_durations_and_counts_come_from_the_trace(
    client: ollama.Client, served: Served
) -> None:
    reply = client.chat(name(served), messages=SEA, options={**GREEDY, "num_predict": 12})
    trace = served.recorder.nth(0)
    served.assert_released(trace, trace.end_reason or EndReason.RUNTIME_ERROR)
    assert reply.done is True
    assert reply.model == name(served)
    assert reply.message.role == "assistant"
    assert reply.message.content
    assert reply.done_reason == trace.end_reason
    assert trace.end_reason in (EndReason.STOP, EndReason.LENGTH)
    assert reply.prompt_eval_count == trace.prompt_tokens > 0
    assert reply.eval_count == trace.completion_tokens
    assert 0 < reply.eval_count <= 12
    assert trace.end_to_end is not None
    assert reply.total_duration == round(trace.end_to_end * 1e9)
    assert reply.load_duration == 0  # the model was loaded before the request
    assert reply.prompt_eval_duration is not None
    assert reply.eval_duration is not None
    assert 0 < reply.prompt_eval_duration + reply.eval_duration <= reply.total_duration


def test_chat_stream_comes_in_pieces_and_ends_with_the_counts(
    client: ollama.Client, served: Served
) -> None:
    options = {**GREEDY, "num_predict": 24}
    parts = list(client.chat(name(served), messages=SEA, options=options, stream=True))
    assert len(parts) > 2
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert all(p.message.role == "assistant" for p in parts)
    assert "".join(p.message.content or "" for p in parts).strip()
    last = parts[-1]
    assert last.message.content == ""
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason(last.done_reason))
    assert last.eval_count == trace.completion_tokens
    assert last.prompt_eval_count == trace.prompt_tokens
    assert trace.end_to_end is not None
    assert last.total_duration == round(trace.end_to_end * 1e9)


def test_generate_in_the_template_raw_and_streamed(client: ollama.Client, served: Served) -> None:
    options = {**GREEDY, "num_predict": 16}
    templated = client.generate(name(served), "Tell me about the sea.", options=options)
    assert templated.done is True
    assert templated.response
    parts = list(
        client.generate(name(served), "Tell me about the sea.", options=options, stream=True)
    )
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.response or "" for p in parts).strip()
    assert parts[-1].eval_count == served.recorder.nth(1).completion_tokens

    # generate wraps the prompt in the chat template: the same prompt as /api/chat's.
    chat = client.chat(name(served), messages=SEA, options=options)
    assert templated.prompt_eval_count == parts[-1].prompt_eval_count == chat.prompt_eval_count

    raw = client.generate(name(served), "The capital of France is", raw=True, options=options)
    assert raw.response
    assert raw.prompt_eval_count is not None
    assert raw.prompt_eval_count < (templated.prompt_eval_count or 0)  # no template around it


def test_stop_option_ends_before_the_stop_string(client: ollama.Client, served: Served) -> None:
    # Every reply of this model to this question starts by naming the sea.
    options = {**GREEDY, "num_predict": 64, "stop": ["Paris", " sea"]}
    stopped = client.chat(name(served), messages=SEA, options=options)
    trace = served.recorder.nth(0)
    assert stopped.done_reason == "stop"
    assert trace.stop_sequence == " sea"
    assert " sea" not in (stopped.message.content or "")
    assert stopped.eval_count is not None
    assert stopped.eval_count < 64


@pytest.mark.own_server  # the catalog and the running models as a fresh server has them
def test_list_show_ps_and_version(client: ollama.Client, served: Served) -> None:
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {name(served), "smollm2-135m"}
    mine = listed[name(served)]
    assert mine.size is not None
    assert mine.size > 1_000_000
    assert mine.details is not None
    assert mine.details.format == "gguf"
    assert mine.details.quantization_level == "Q4_1"
    assert listed["smollm2-135m"].digest is not None
    assert listed["smollm2-135m"].digest.startswith("sha256:")

    shown = client.show(name(served))
    assert shown.details is not None
    assert shown.details.family == "llama"
    assert shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == served.model().context_length
    # The model's GGUF runs here, so its calls are constrained by a grammar: tools work.
    assert shown.capabilities == ["completion", "tools"]
    assert client.show("smollm2-135m:latest").details is not None  # Ollama's tag is understood
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404

    running = client.ps().models
    assert [m.model for m in running] == [name(served)]
    assert running[0].expires_at is None  # this runtime keeps its model loaded for ever
    # Read raw: clients before 0.5.4 drop the field.
    (raw,) = plainhttp.get(f"{served.url}/api/ps", timeout=NET).json()["models"]
    assert raw["context_length"] == served.model().context_length

    version = plainhttp.get(f"{served.url}/api/version", timeout=NET).json()
    assert set(version) == {"version", "tokenbelt"}


@pytest.mark.own_server  # pulls into this test's own home
def test_pull_of_the_embedded_alias_reports_progress(client: ollama.Client) -> None:
    parts = list(client.pull("smollm2-135m", stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest"
    assert statuses[-2:] == ["verifying sha256 digest", "success"]
    progress = [p for p in parts if p.digest]
    assert progress, statuses
    assert all(p.digest == progress[0].digest for p in progress)
    assert progress[0].digest is not None
    assert progress[0].digest.startswith("sha256:")
    assert progress[-1].completed == progress[-1].total
    assert progress[-1].total is not None
    assert progress[-1].total > 1_000_000

    assert client.pull("smollm2-135m").status == "success"
    with pytest.raises(ollama.ResponseError) as missing:
        client.pull("no-such-model")
    assert missing.value.status_code == 404


@pytest.mark.own_server  # deletes from this test's own home
def test_delete_keeps_a_packaged_file_and_refuses_an_unknown_name(
    client: ollama.Client,
) -> None:
    assert client.delete("smollm2-135m").status == "success"
    assert "smollm2-135m" in {m.model for m in client.list().models}  # shipped in a package
    with pytest.raises(ollama.ResponseError) as missing:
        client.delete("no-such-model")
    assert missing.value.status_code == 404


def test_embed_gives_unit_vectors_one_per_input(client: ollama.Client, served: Served) -> None:
    one = client.embed(name(served), "hello")
    many = client.embed(name(served), ["hello", "hello", "a quiet evening by the sea"])
    assert len(one.embeddings) == 1
    assert len(one.embeddings[0]) == 576
    assert many.embeddings[0] == many.embeddings[1] != many.embeddings[2]
    assert all(abs(math.fsum(x * x for x in v) - 1.0) < 1e-4 for v in many.embeddings)
    assert many.prompt_eval_count is not None
    assert many.prompt_eval_count > 3
    legacy = client.embeddings(name(served), "hello")
    norm = math.sqrt(math.fsum(x * x for x in legacy.embedding))
    assert norm > 0
    assert all(
        abs(a - b / norm) < 1e-4 for a, b in zip(one.embeddings[0], legacy.embedding, strict=True)
    )
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(name(served), ["word " * 3000], truncate=False)
    assert refused.value.status_code == 400
    assert "input[0] has" in str(refused.value.error)
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(name(served), "hello", dimensions=64)
    assert refused.value.status_code == 400
    assert "Matryoshka" in str(refused.value.error)


#: what langchain-ollama's OllamaEmbeddings sends on every call: each option, unset
UNSET_OPTIONS = dict.fromkeys(
    ["mirostat", "mirostat_eta", "num_ctx", "num_gpu", "num_thread", "stop", "temperature"]
)


def test_embed_takes_unset_options_and_an_empty_input_loads(served: Served) -> None:
    url = f"{served.url}/api/embed"
    body = {"model": name(served), "input": ["sea"], "options": UNSET_OPTIONS}
    answer = plainhttp.post(url, json=body, timeout=NET)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["embeddings"]) == 1
    refused = plainhttp.post(url, json={**body, "options": {"temperature": 0.5}}, timeout=NET)
    assert refused.status_code == 400
    assert "options.temperature" in refused.json()["error"]
    for empty in ("", []):  # Ollama's way to load a model for embeddings
        loaded = plainhttp.post(url, json={"model": name(served), "input": empty}, timeout=NET)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["embeddings"] == []
    assert len(served.recorder.enqueued()) == 1  # only the one with an input


def test_embed_num_ctx_bounds_each_input(served: Served) -> None:
    """Ollama's ``num_ctx`` on the embedding routes: the most tokens of an input, cut
    there with ``truncate`` (its default), else a 400 naming the input and the window."""
    url = f"{served.url}/api/embed"
    body = {"model": name(served), "input": ["sea " * 100], "options": {"num_ctx": 16}}
    cut = plainhttp.post(url, json=body, timeout=NET)
    assert cut.status_code == 200, cut.text
    assert cut.json()["prompt_eval_count"] == 16
    whole = plainhttp.post(url, json={**body, "options": {"num_ctx": 4096}}, timeout=NET)
    assert whole.json()["prompt_eval_count"] > 16
    refused = plainhttp.post(url, json={**body, "truncate": False}, timeout=NET)
    assert refused.status_code == 400
    assert "input[0] has" in refused.json()["error"]
    assert "window holds at most 16" in refused.json()["error"]
    legacy = {"model": name(served), "prompt": "sea " * 100, "options": {"num_ctx": 16}}
    answer = plainhttp.post(f"{served.url}/api/embeddings", json=legacy, timeout=NET)
    assert answer.status_code == 200, answer.text
    for bad in (0, "16", True):
        wrong = plainhttp.post(url, json={**body, "options": {"num_ctx": bad}}, timeout=NET)
        assert wrong.status_code == 400
        assert "options.num_ctx must be" in wrong.json()["error"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"format": {"type": "strange"}}, "format"),
        ({"format": {"type": "integer", "minimum": 5, "maximum": 3}}, "format"),
        ({"options": {"mirostat": 1}}, "options.mirostat"),
        ({"options": {"num_ctx": 10**7}}, "options.num_ctx"),
        ({"options": {"num_thread": 2}}, "options.num_thread: the decode threads are set"),
        ({"options": {"num_gpu": 0, "use_mmap": True}}, "options.use_mmap: how the weights"),
        ({"options": {"tfs_z": 1.0}}, "options.tfs_z: tail-free sampling is gone"),
        ({"think": True}, "think"),
        ({"keep_alive": "soon"}, "keep_alive"),
    ],
    ids=[
        "format-xml",
        "format-unenforceable",
        "unknown-option",
        "num-ctx-too-big",
        "num-thread",
        "load-settings",
        "tfs-z",
        "think",
        "keep",
    ],
)
def test_unsupported_parameters_are_refused_by_name(
    client: ollama.Client, served: Served, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(name(served), messages=SEA, **kwargs)  # type: ignore[arg-type]
    assert refused.value.status_code == 400
    assert param in str(refused.value.error)
    assert served.recorder.events == []  # refused before anything was queued


@pytest.mark.own_server  # unloads and reloads the model
def test_keep_alive_zero_unloads_and_the_next_request_loads_again(
    client: ollama.Client, served: Served
) -> None:
    model = served.model()
    unloaded = client.generate(name(served), "", keep_alive=0)
    assert (unloaded.done, unloaded.done_reason) == (True, "unload")
    assert model.state is ModelState.IDLE_UNLOADED
    assert client.ps().models == []

    reply = client.chat(name(served), messages=SEA, options={"num_predict": 4}, keep_alive="5m")
    assert reply.load_duration is not None
    assert reply.load_duration > 0
    assert reply.total_duration is not None
    assert reply.total_duration > reply.load_duration
    assert model.state is ModelState.READY
    (running,) = client.ps().models
    assert running.expires_at is not None
    assert model.idle_keep_alive == 300.0  # that request's own
    assert model.keep_alive is None  # the server's stays

    loaded = client.chat(name(served), messages=[], keep_alive=-1)
    assert loaded.done_reason == "load"
    assert model.idle_keep_alive is None


@pytest.mark.own_server  # unloads and reloads the model
def test_a_load_after_an_unload_stays_loaded_and_one_without_keep_alive_is_a_load(
    client: ollama.Client, served: Served
) -> None:
    """Ollama's load request (no messages): a positive keep_alive after a 0 keeps the
    model it loads, and one that names no keep_alive is a load, not an unload."""
    model = served.model()
    assert client.generate(name(served), "", keep_alive=0).done_reason == "unload"
    assert model.state is ModelState.IDLE_UNLOADED
    assert client.chat(name(served), messages=[], keep_alive=300).done_reason == "load"
    assert model.state is ModelState.READY
    assert model.idle_keep_alive == 300.0
    (running,) = client.ps().models
    assert running.name == name(served)

    again = client.generate(name(served), "")  # no keep_alive given: the server's
    assert again.done_reason == "load"
    assert model.state is ModelState.READY
    assert model.idle_keep_alive == model.keep_alive


@pytest.mark.own_server  # unloads and reloads the model
@pytest.mark.parametrize(
    ("route", "body"), [("/api/embed", {"input": ["sea"]}), ("/api/embeddings", {"prompt": "sea"})]
)
def test_an_embedding_keep_alive_holds_for_that_request_only(
    client: ollama.Client, served: Served, route: str, body: dict[str, object]
) -> None:
    """As on ``/api/chat``: an embedding's ``keep_alive`` is that request's own (``0``
    unloads the model after it), never the server's default for every later request."""
    model = served.model()
    url = f"{served.url}{route}"
    assert model.keep_alive is None  # the server's: loaded for ever

    answer = plainhttp.post(url, json={"model": name(served), **body, "keep_alive": 0}, timeout=NET)
    assert answer.status_code == 200, answer.text
    eventually(lambda: model.state is ModelState.IDLE_UNLOADED, "the unload after that embedding")
    assert model.keep_alive is None  # the server's stays

    # Another client, no keep_alive: the model loads again, once, and stays loaded.
    loads = model.loads
    for n in (1, 2):
        reply = client.chat(name(served), messages=SEA, options={"num_predict": 2})
        served.recorder.wait(served.recorder.nth(n), "released")
        assert reply.done
        assert model.idle_keep_alive is None
        assert model.state is ModelState.READY
    assert model.loads == loads + 1

    # A later embedding's own keep_alive holds until the next request brings its own.
    again = plainhttp.post(
        url, json={"model": name(served), **body, "keep_alive": "5m"}, timeout=NET
    )
    assert again.status_code == 200, again.text
    assert (model.keep_alive, model.idle_keep_alive) == (None, 300.0)
    plain = plainhttp.post(url, json={"model": name(served), **body}, timeout=NET)
    assert plain.status_code == 200, plain.text
    assert (model.keep_alive, model.idle_keep_alive) == (None, None)
    assert model.state is ModelState.READY


def test_request_id_header_and_deadline_extension(served: Served) -> None:
    body = {
        "model": name(served),
        "prompt": LONG_PROMPT,
        "raw": True,
        "stream": False,
        "tokenbelt": {"first_token_timeout": 0.001},
    }
    answer = plainhttp.post(f"{served.url}/api/generate", json=body, timeout=NET)
    trace = served.recorder.nth(0)
    assert answer.headers["x-request-id"] == trace.request_id
    served.assert_released(trace, EndReason.FIRST_TOKEN_TIMEOUT)
    assert answer.status_code == 504
    error = answer.json()
    assert "first_token_timeout" in error["error"]
    assert error["tokenbelt"]["end_reason"] == "first_token_timeout"

    streamed = plainhttp.post(
        f"{served.url}/api/generate", json={**body, "stream": True}, timeout=NET
    ).text.splitlines()
    assert len(streamed) == 1  # no token came: only the last object
    assert '"done_reason":"first_token_timeout"' in streamed[0]


def test_closing_a_stream_early_is_client_disconnect(client: ollama.Client, served: Served) -> None:
    parts = client.chat(
        name(served), messages=SEA, options={**GREEDY, "num_predict": 2000}, stream=True
    )
    first = next(parts)
    assert first.done is False
    parts.close()  # type: ignore[attr-defined]
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason.CLIENT_DISCONNECT)
    assert 0 < trace.completion_tokens < 2000
    assert record(served, trace.request_id)["end_reason"] == "client_disconnect"


def test_a_non_streaming_chat_whose_client_leaves_is_released(served: Served) -> None:
    # The only slot is held by a request nobody reads: the chat can only wait in the queue,
    # and its client gives up (a read timeout), closing the connection.
    hog = served.model().stream(prompt="Once upon a time", max_tokens=4000)
    served.recorder.wait(hog.trace, "admitted")
    with (
        connect_ollama(served.url, httpx.Timeout(NET, read=1.0)) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.chat(name(served), messages=SEA)
    trace = served.recorder.nth(1)
    served.recorder.wait(trace, "released")
    assert trace.end_reason is EndReason.CLIENT_DISCONNECT
    assert trace.admitted is None
    assert record(served, trace.request_id)["end_reason"] == "client_disconnect"
    hog.cancel()
    served.assert_released(hog.trace, EndReason.USER_CANCEL)


# -- the wire format, read by curl ------------------------------------------------------------


def curl(url: str, body: str, headers_file: str) -> list[str]:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    done = subprocess.run(
        [
            *("curl", "-sS", "-N", "-D", headers_file, "-H", "content-type: application/json"),
            *("--max-time", str(int(NET)), "--data-binary", body, url),
        ],
        capture_output=True,
        check=True,
        text=True,
        timeout=NET + 5,
    )
    return done.stdout.split("\n")


@pytest.mark.parametrize("route", ["generate", "chat"])
def test_ndjson_framing_read_by_curl(served: Served, route: str, tmp_path: Path) -> None:
    body: dict[str, object] = {"model": name(served), "options": {**GREEDY, "num_predict": 10}}
    if route == "chat":
        body["messages"] = SEA
    else:
        body["prompt"] = "Tell me about the sea."
    lines = curl(f"{served.url}/api/{route}", json.dumps(body), str(tmp_path / "headers"))
    assert lines[-1] == ""  # every object ends with a newline, the last one too
    objects = [json.loads(line) for line in lines[:-1]]  # one JSON object per line
    assert len(objects) >= 2
    assert all(isinstance(o, dict) for o in objects)
    assert [o["done"] for o in objects] == [False] * (len(objects) - 1) + [True]
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason(objects[-1]["done_reason"]))
    assert objects[-1]["eval_count"] == trace.completion_tokens
    extension = objects[-1]["tokenbelt"]
    assert extension["end_reason"] == objects[-1]["done_reason"]
    assert extension["trace"]["request_id"] == trace.request_id
    if route == "chat":
        text = "".join(o["message"]["content"] for o in objects)
    else:
        text = "".join(o["response"] for o in objects)
    assert text.strip()
    headers = (tmp_path / "headers").read_text().lower()
    assert "content-type: application/x-ndjson" in headers
    assert f"x-request-id: {trace.request_id}" in headers


def test_format_constrains_the_reply(client: ollama.Client, served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    reply = client.chat(name(served), messages=SEA, format=schema, options={"num_predict": 100})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content or ""), schema)
    generated = client.generate(
        name(served), "A person:", format="json", options={"num_predict": 60, "seed": 1}
    )
    assert generated.response.startswith("{")  # prose without the grammar
    if generated.done_reason == "stop":  # a cut reply is returned as it is
        assert isinstance(json.loads(generated.response), dict)
    # The ollama client checks the kind of format; a raw body can send any.
    bad = {"model": name(served), "messages": SEA, "format": "xml"}
    refused = plainhttp.post(f"{served.url}/api/chat", json=bad, timeout=NET)
    assert refused.status_code == 400
    assert "format" in refused.json()["error"]


def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
      city: the city's name
    """
    return "sunny"


def _asked(city: str) -> dict[str, object]:
    return {"role": "user", "content": f"What is the weather in {city}?"}


def _called(city: str) -> dict[str, object]:
    call = {"function": {"name": "get_weather", "arguments": {"city": city}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


#: a conversation whose assistant called the tool for each question: with Ollama's
#: ``auto`` (it has no tool_choice), the small model calls it again for the next one
CALLING = [_asked("Rome"), _called("Rome"), _asked("Berlin"), _called("Berlin"), _asked("Paris")]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


def test_chat_with_tools_returns_a_parsed_call(client: ollama.Client, served: Served) -> None:
    options = {"temperature": 0.0, "num_predict": 48}
    reply = client.chat(name(served), messages=CALLING, tools=[get_weather], options=options)
    assert reply.done_reason == "stop"
    assert reply.message.tool_calls is not None
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER_SCHEMA)
    assert "<tool_call>" not in (reply.message.content or "")

    # Streamed: text pieces (none here), then the whole call in one chunk, then the end.
    chunks = list(
        client.chat(
            name(served), messages=CALLING, tools=[get_weather], options=options, stream=True
        )
    )
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1
    assert not with_calls[0].done
    assert chunks[-1].done
    assert chunks[-1].done_reason == "stop"
    (streamed,) = with_calls[0].message.tool_calls or []
    assert streamed.function.name == "get_weather"
    assert dict(streamed.function.arguments) == dict(call.function.arguments)
    assert "<tool_call>" not in "".join(c.message.content or "" for c in chunks)

    # The raw line: Ollama's shape, with the call's index (Ollama >= 0.12 sends it).
    raw = plainhttp.post(
        f"{served.url}/api/chat",
        json={
            "model": name(served),
            "messages": CALLING,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA},
                }
            ],
            "stream": False,
            "options": options,
        },
        timeout=NET,
    ).json()
    (line,) = raw["message"]["tool_calls"]
    assert line["function"]["index"] == 0
    assert isinstance(line["function"]["arguments"], dict)


def test_top_level_fields_some_clients_send_are_honoured(served: Served) -> None:
    """ollama-ai-provider-v2 (the AI SDK's Ollama provider) sends ``temperature``,
    ``top_p``, ``max_output_tokens`` and ``tool_choice`` at the top level; Ollama drops
    them, tokenbelt does what they ask."""
    url = f"{served.url}/api/chat"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
    ask = {"model": name(served), "messages": [_asked("Oslo")], "stream": False, "think": False}
    short = plainhttp.post(url, json={**ask, "temperature": 0, "max_output_tokens": 3}, timeout=NET)
    assert short.status_code == 200, short.text
    assert (short.json()["eval_count"], short.json()["done_reason"]) == (3, "length")
    forced = {**ask, "tools": [tool], "max_output_tokens": 48}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        called = plainhttp.post(url, json={**forced, "tool_choice": choice}, timeout=NET).json()
        (call,) = called["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
    both = {**ask, "temperature": 0.5, "options": {"temperature": 0.7}}
    refused = plainhttp.post(url, json=both, timeout=NET)
    assert refused.status_code == 400
    assert "temperature 0.5 and options.temperature 0.7 disagree" in refused.json()["error"]
    same = {**ask, "max_output_tokens": 2, "options": {"num_predict": 2}}
    assert plainhttp.post(url, json=same, timeout=NET).json()["eval_count"] == 2


def test_a_tool_result_turn_gets_a_text_answer(client: ollama.Client, served: Served) -> None:
    messages = [
        _asked("Paris"),
        _called("Paris"),
        {"role": "tool", "content": "sunny, 24 C", "tool_name": "get_weather"},
    ]
    options = {"temperature": 0.0, "num_predict": 24}
    reply = client.chat(name(served), messages=messages, tools=[get_weather], options=options)
    assert reply.message.content
    assert not reply.message.tool_calls
    # The same turns without tools: the earlier call and its result still reach the prompt.
    again = client.chat(name(served), messages=messages, options=options)
    assert again.message.content
    assert served.recorder.nth(1).prompt_tokens < served.recorder.nth(0).prompt_tokens


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"format": "json"}, "format"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        (
            {"messages": [{**_asked("Oslo"), "tool_calls": _called("Oslo")["tool_calls"]}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}, *SEA]},
            "messages.0.tool_calls.0.function.name",
        ),
    ],
    ids=["format-and-tools", "nameless-tool", "calls-in-a-user-turn", "nameless-call"],
)
def test_bad_tool_input_is_one_400_naming_the_field(
    served: Served, change: dict[str, object], named: str
) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
    body = {"model": name(served), "messages": SEA, "tools": [tool], "stream": False, **change}
    refused = plainhttp.post(f"{served.url}/api/chat", json=body, timeout=NET)
    assert refused.status_code == 400
    assert set(refused.json()) == {"error"}
    assert named in refused.json()["error"]
    assert served.recorder.events == []


@pytest.mark.parametrize("keep_alive", [1e15, -1.5e16, "99999999h"])
def test_a_keep_alive_past_its_range_is_refused_naming_it_and_ps_still_answers(
    client: ollama.Client, served: Served, keep_alive: float | str
) -> None:
    """A year either way at most: past it no timer can wait (the keep-alive thread died)
    and no date can be written (``/api/ps`` answered 500 until it was reset)."""
    before = served.model().keep_alive
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(name(served), messages=SEA, keep_alive=keep_alive)
    assert refused.value.status_code == 400
    assert "keep_alive" in str(refused.value.error)
    assert "at most 31536000 seconds" in str(refused.value.error)
    assert served.recorder.events == []  # refused before anything was queued
    assert served.model().keep_alive == before  # unchanged
    response = plainhttp.get(f"{served.url}/api/ps", timeout=NET)
    assert response.status_code == 200


def test_penalties_change_the_greedy_text_and_off_values_are_accepted(
    client: ollama.Client, served: Served
) -> None:
    """Ollama's documented options: its penalties work as on /v1; mirostat 0 and
    typical_p 1.0 (its defaults, which some clients send on every request) are off."""
    ask = [{"role": "user", "content": "Write the word 'the' ten times."}]

    def text(**options: object) -> str:
        reply = client.chat(
            name(served), messages=ask, options={"temperature": 0, "num_predict": 30, **options}
        )
        return reply.message.content or ""

    plain = text()
    assert text() == plain  # greedy repeats: a difference below comes from the penalty
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain
    assert text(mirostat=0, typical_p=1.0, frequency_penalty=0.0) == plain
    with pytest.raises(ollama.ResponseError) as refused:
        text(typical_p=0.5)
    assert refused.value.status_code == 400
    assert "options.typical_p" in str(refused.value.error)
    assert "without typical sampling" in str(refused.value.error)


def test_logprobs_say_which_route_returns_them(served: Served) -> None:
    for asked in ({"logprobs": True}, {"top_logprobs": 2}):
        body = {"model": name(served), "messages": SEA, "stream": False, **asked}
        r = httpx.post(f"{served.url}/api/chat", json=body, timeout=NET)
        assert r.status_code == 400, r.text
        assert "its OpenAI chat completions return them" in r.json()["error"]
    assert served.recorder.events == []  # refused before anything was queued
