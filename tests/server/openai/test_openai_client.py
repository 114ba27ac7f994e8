"""The official ``openai`` client works unchanged, ``stream.close()`` mid-stream included."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest

from tokenbelt import EndReason, ScriptedEngine

from ..conftest import NET, Served, ServeFactory, scripted_runtime, words

SCRIPT = words(6)


@pytest.fixture
def served(serve: ServeFactory) -> Served:
    engines = [ScriptedEngine(SCRIPT, delay=0), ScriptedEngine(words(100_000), delay=0.002)]
    runtime = scripted_runtime(engines[0])
    runtime.add_engines("endless", [engines[1]])
    return serve(runtime)


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


def test_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.id.startswith("req_")
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "".join(SCRIPT[:4])
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 4
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 4


def test_chat_completion_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(SCRIPT)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(SCRIPT)


def test_text_completion(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="scripted", prompt="once upon a time", max_tokens=2)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == "".join(SCRIPT[:2])
    assert reply.choices[0].finish_reason == "length"


def test_text_completion_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="scripted", prompt="once", stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == "".join(SCRIPT)


def test_models_list(client: openai.OpenAI) -> None:
    # Only the served models: the catalog's aliases are not servable until loaded.
    assert sorted(m.id for m in client.models.list()) == ["endless", "scripted"]


def test_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve("scripted")
    assert (model.id, model.object, model.owned_by) == ("scripted", "model", "tokenbelt")
    # A catalog alias this server was not started with is not served: 404, not a listing.
    for name in ("smollm2-135m", "nope"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(name)
        assert caught.value.code == "model_not_found"
        assert caught.value.param == "model"
        assert name in caught.value.message


def test_stream_close_mid_stream_is_client_disconnect(
    client: openai.OpenAI, served: Served
) -> None:
    stream = client.chat.completions.create(
        model="endless",
        messages=[{"role": "user", "content": "go on"}],
        max_tokens=100_000,
        stream=True,
    )
    first = next(iter(stream))
    assert first.choices[0].delta.content
    stream.close()
    trace = served.recorder.by_id(first.id)
    served.assert_released(trace, EndReason.CLIENT_DISCONNECT)
    assert trace.completion_tokens < 100_000


def test_errors_arrive_as_openai_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:  # 400, as OpenAI answers, not 422
        client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "x"}], n=0
        )
    assert bad.value.param == "n"


def test_a_deadline_504_is_one_server_request(client: openai.OpenAI, served: Served) -> None:
    # The SDK retries a 504 twice by default; the server says not to: it stopped that work.
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model="endless",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"tokenbelt": {"total_timeout": 0.2}},
        )
    assert caught.value.status_code == 504
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert caught.value.code == "total_timeout"
    enqueued = [e for e in served.recorder.events if e.kind == "enqueued"]
    assert len(enqueued) == 1
    served.assert_released(enqueued[0].trace, EndReason.TOTAL_TIMEOUT)


def test_a_shutdown_503_is_not_sent_again(client: openai.OpenAI, served: Served) -> None:
    errors: list[openai.APIStatusError] = []

    def ask() -> None:
        try:
            client.chat.completions.create(
                model="endless", messages=[{"role": "user", "content": "hi"}], max_tokens=50_000
            )
        except openai.APIStatusError as exc:
            errors.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    trace = served.recorder.nth(0)
    served.recorder.wait(trace, "first_token")
    served.runtime.close()
    asking.join(NET)
    assert not asking.is_alive()
    (error,) = errors
    assert error.status_code == 503
    assert error.response.headers["x-should-retry"] == "false"
    assert [e.kind for e in served.recorder.events].count("enqueued") == 1


def test_closing_a_stream_of_two_choices_stops_both(serve: ServeFactory) -> None:
    engines = [ScriptedEngine(words(100_000), delay=0.002) for _ in range(2)]
    served = serve(scripted_runtime(*engines, slots=2))
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as client:
        stream = client.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=100_000,
            n=2,
            stream=True,
        )
        seen: set[int] = set()
        for chunk in stream:
            seen.update(c.index for c in chunk.choices)
            if seen == {0, 1}:
                break
        stream.close()
    traces = [served.recorder.nth(n) for n in range(2)]
    for trace in traces:  # both, before asking whether the model is idle
        served.recorder.wait(trace, "released")
    for trace in traces:
        served.assert_released(trace, EndReason.CLIENT_DISCONNECT)


def test_a_deadline_of_two_choices_is_one_504(client: openai.OpenAI, served: Served) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(
            model="endless",
            prompt="go on",
            n=2,
            extra_body={"tokenbelt": {"total_timeout": 0.2}},
        )
    assert caught.value.status_code == 504
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert [e.kind for e in served.recorder.events].count("enqueued") == 2  # n, sent once
