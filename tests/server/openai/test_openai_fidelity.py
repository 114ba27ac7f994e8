"""What real OpenAI clients send and read, on the real default model through the ``openai`` SDK:
message shapes, the sampling parameters, log-probabilities, several choices, echo, and a
400 that names every parameter the server cannot honour.
"""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tokenbelt import GenerationRequest
from tokenbelt.models import default_model_path

from ..conftest import NET, Served, ServeFactory, SharedServer, real_runtime, shared_server

pytestmark = pytest.mark.model

MODEL = Path(default_model_path()).stem
QUESTION = "Name a colour."
USER = [{"role": "user", "content": QUESTION}]
PROMPT_600 = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
REPEAT = [{"role": "user", "content": "Write the word 'the' ten times."}]


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    """One server for the module: its tests only send requests and read their own traces."""
    # Without the prefix cache every prompt is computed in full: greedy text repeats
    # whatever ran before or beside it, so two answers can be compared.
    with shared_server(lambda: real_runtime(prefix_cache=False, slots=2)) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


@pytest.fixture
async def aclient(served: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


def greedy(client: openai.OpenAI, messages: Any, **extra: Any) -> Any:
    params: dict[str, Any] = {"temperature": 0, "max_tokens": 8, **extra}
    return client.chat.completions.create(model=MODEL, messages=messages, **params)


def token_id(served: Served, text: str) -> int:
    """The id of the (last) token of ``text`` in the model's vocabulary."""
    engine: Any = served.model().engines[0]
    return int(engine.tokenize_request(GenerationRequest(prompt=text))[-1])


# -- message shapes ---------------------------------------------------------------------------


def test_content_parts_and_developer_role_read_as_text_and_system(
    client: openai.OpenAI, served: Served
) -> None:
    plain = greedy(client, [{"role": "system", "content": "Be brief."}, *USER])
    parts = greedy(
        client,
        [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
        ],
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage is not None
    assert plain.usage is not None
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_name_and_tool_messages_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather?", "name": "ada"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [WEATHER_CALL]},
            {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
        ],
        max_tokens=4,
    )
    assert reply.choices[0].message.content


WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": "{}"},
}


@pytest.mark.parametrize(
    "before",
    [
        [{"role": "assistant", "content": "Let me look."}],  # no call at all
        [{"role": "assistant", "content": None, "tool_calls": [{**WEATHER_CALL, "id": "call_9"}]}],
        # answered a turn too late: a user turn came between the call and the result
        [
            {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
            {"role": "user", "content": "Well?"},
        ],
    ],
)
def test_a_tool_message_that_answers_no_call_is_a_400(
    client: openai.OpenAI, before: list[dict[str, object]]
) -> None:
    messages = [
        {"role": "user", "content": "What is the weather?"},
        *before,
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    at = len(messages) - 1
    assert caught.value.param == f"messages.{at}.tool_call_id"
    assert "'call_1' is not among the tool_calls" in caught.value.message


def test_an_image_part_is_a_400_naming_the_missing_vision(client: openai.OpenAI) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}
            ],
        )
    assert caught.value.param == "messages.0.content.1"
    assert "has no vision" in caught.value.message


def _file_part(data: bytes, media: str, name: str) -> dict[str, object]:
    encoded = base64.b64encode(data).decode()
    return {
        "type": "file",
        "file": {"filename": name, "file_data": f"data:{media};base64,{encoded}"},
    }


def test_a_text_file_part_is_read_as_its_text(client: openai.OpenAI) -> None:
    ask = {"type": "text", "text": "Summarize it."}
    parts = [ask, _file_part(b"milk, eggs\nbread", "text/plain", "notes.txt")]
    sent = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],
        max_tokens=1,  # type: ignore[misc,list-item]
    )
    said = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Summarize it.\nnotes.txt:\nmilk, eggs\nbread"}],
        max_tokens=1,
    )
    assert sent.usage is not None
    assert said.usage is not None
    assert sent.usage.prompt_tokens == said.usage.prompt_tokens
    pdf = _file_part(b"%PDF-1.4", "application/pdf", "a.pdf")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [ask, pdf]}],  # type: ignore[misc,list-item]
        )
    assert caught.value.param == "messages.0.content.1.file.file_data"
    assert "extract a PDF's or a document's text first" in caught.value.message


# -- every parameter works or is a 400 --------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"extra_body": {"colour": "blue"}}, "colour"),
        ({"stream_options": {"include_usage": True, "colour": "blue"}}, "stream_options.colour"),
        ({"temperature": 7}, "temperature"),
        ({"n": 17}, "n"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"10000000": 1}}, "logit_bias"),  # not in the vocabulary
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ],
)
def test_bad_or_unsupported_parameters_are_400s_that_name_them(
    client: openai.OpenAI, served: Served, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, **extra)
    assert caught.value.status_code == 400
    assert caught.value.param is not None
    assert caught.value.param.startswith(param), caught.value.body
    assert served.recorder.events == []  # refused before any compute


def test_completion_only_parameters(client: openai.OpenAI) -> None:
    for extra, param in (
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 6}, "logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="Once", max_tokens=2, **extra)
        assert caught.value.param == param


def test_fields_without_meaning_here_are_accepted(client: openai.OpenAI) -> None:
    reply = greedy(client, USER, user="ada", store=False, metadata={"k": "v"}, service_tier="auto")
    assert reply.choices[0].message.content
    # Text is what every reply is: saying so is no error.
    assert greedy(client, USER, modalities=["text"]).choices[0].message.content


# -- log-probabilities ------------------------------------------------------------------------


def check_logprobs(content: list[Any], text: str, top: int) -> None:
    assert content
    assert "".join(t.token for t in content) == text
    for t in content:
        assert t.logprob <= 0.0
        assert bytes(t.bytes or b"").decode("utf-8", "replace") == t.token
        assert len(t.top_logprobs) == top
        alternatives = [a.logprob for a in t.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        assert sum(math.exp(a) for a in alternatives) <= 1.0 + 1e-6
        if top:  # greedy: the chosen token is the likeliest one
            assert t.top_logprobs[0].token == t.token
            assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def test_chat_logprobs_stream_and_not(client: openai.OpenAI) -> None:
    reply = greedy(client, USER, logprobs=True, top_logprobs=3)
    text = reply.choices[0].message.content or ""
    assert reply.choices[0].logprobs is not None
    content = reply.choices[0].logprobs.content or []
    check_logprobs(content, text, 3)
    assert len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]

    streamed = []
    chunks = list(greedy(client, USER, logprobs=True, top_logprobs=3, stream=True))
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


@pytest.mark.anyio
async def test_chat_logprobs_async(aclient: openai.AsyncOpenAI) -> None:
    reply = await aclient.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=6, logprobs=True
    )
    assert reply.choices[0].logprobs is not None
    content = reply.choices[0].logprobs.content or []
    check_logprobs(content, reply.choices[0].message.content or "", 0)


@pytest.mark.anyio
async def test_async_stream_of_parts_with_logprobs(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=[{"role": "developer", "content": [{"type": "text", "text": QUESTION}]}],
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    text, content = "", []
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            content += choice.logprobs.content or [] if choice.logprobs else []
    check_logprobs(content, text, 1)


def test_legacy_logprobs_and_echo(client: openai.OpenAI) -> None:
    prompt = "The sky is"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=5, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None
    lp = choice.logprobs
    assert "".join(lp.tokens or []) == choice.text
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(5)]
    for token, logprob, top in zip(
        lp.tokens or [], lp.token_logprobs or [], lp.top_logprobs or [], strict=True
    ):
        assert logprob <= 0.0
        assert len(top) == 2
        assert max(top, key=top.__getitem__) == token
    # Sampled: a step whose token is not among the likeliest still lists it (OpenAI's
    # legacy logprobs hold up to logprobs + 1 entries).
    hot = client.completions.create(
        model=MODEL, prompt=prompt, temperature=2, seed=3, max_tokens=12, logprobs=1
    ).choices[0]
    assert hot.logprobs is not None
    tops = hot.logprobs.top_logprobs or []
    for token, logprob, top in zip(
        hot.logprobs.tokens or [], hot.logprobs.token_logprobs or [], tops, strict=True
    ):
        assert top[token] == logprob
    assert {len(top) for top in tops} == {1, 2}

    echoed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5)
    assert echoed.choices[0].text == choice.text
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=5, echo=True
    )
    assert echoed.choices[0].text == prompt + choice.text
    stream = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=5, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == prompt + choice.text


def test_a_prompt_of_token_ids_completes_as_its_text_does(client: openai.OpenAI) -> None:
    """OpenAI's completions take token ids (lm-evaluation-harness sends them): the ids of
    a text prompt (as ``return_token_ids`` gives them) complete as the text does, as a
    list or a list holding one list."""
    prompt = "The sky is"
    asked: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 6}
    as_text = client.completions.create(
        prompt=prompt, extra_body={"return_token_ids": True}, **asked
    )
    ids = (as_text.choices[0].model_extra or {})["prompt_token_ids"]
    assert ids
    assert all(isinstance(i, int) for i in ids)
    for form in (ids, [ids]):
        as_ids = client.completions.create(prompt=form, **asked)
        assert as_ids.choices[0].text == as_text.choices[0].text
        assert as_ids.usage is not None
        assert as_ids.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(prompt=ids, stream=True, **asked)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == as_text.choices[0].text


@pytest.mark.parametrize(
    ("prompt", "extra", "param"),
    [
        ([10_000_000], {}, "prompt"),  # not in the vocabulary
        ([[1, 2], [3]], {}, "prompt"),  # two prompts
        ([], {}, "prompt"),
        ([-1], {}, "prompt"),
        ([1, 2], {"echo": True}, "echo"),  # echo gives text prompts back
    ],
)
def test_bad_token_id_prompts_are_400s_that_name_them(
    client: openai.OpenAI, served: Served, prompt: Any, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **extra)
    assert caught.value.param is not None
    assert caught.value.param.startswith(param), caught.value.body
    assert served.recorder.events == []  # refused before any compute


# -- penalties and bias -----------------------------------------------------------------------


def test_penalties_change_the_greedy_text(client: openai.OpenAI) -> None:
    def text(**extra: Any) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=REPEAT, temperature=0, max_tokens=30, **extra
        )
        return reply.choices[0].message.content or ""

    plain = text()
    assert text() == plain  # greedy repeats: a difference below comes from the penalty
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain
    assert text(frequency_penalty=0.0, presence_penalty=0.0) == plain


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, served: Served) -> None:
    reply = greedy(client, USER, logprobs=True)
    assert reply.choices[0].logprobs is not None
    first = (reply.choices[0].logprobs.content or [])[0].token
    banned = greedy(client, USER, logprobs=True, logit_bias={str(token_id(served, first)): -100})
    assert banned.choices[0].logprobs is not None
    assert (banned.choices[0].logprobs.content or [])[0].token != first

    blue = token_id(served, " blue")
    forced = greedy(client, USER, max_tokens=3, logit_bias={str(blue): 100})
    assert forced.choices[0].message.content == " blue" * 3


# -- several choices --------------------------------------------------------------------------


def test_two_choices_stream_and_not(client: openai.OpenAI, served: Served) -> None:
    # Two sequences decoded in one batch may round apart, so their greedy texts are not
    # compared; each is a whole answer of its own.
    reply = greedy(client, USER, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content for c in reply.choices)
    assert [c.finish_reason for c in reply.choices] == ["length", "length"]
    assert reply.usage is not None
    one = greedy(client, USER)
    assert one.usage is not None
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert reply.usage.completion_tokens == 2 * 8

    chunks = list(greedy(client, USER, n=2, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    texts: dict[int, str] = {0: "", 1: ""}
    finished = {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index not in finished  # nothing after a choice's last chunk
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert all(texts.values())
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2 * 8


def test_two_sampled_choices_with_one_seed_differ(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=1.0, max_tokens=12, n=2, seed=7
    )
    first, second = (c.message.content for c in reply.choices)
    assert first != second  # each choice takes a seed of its own (seed + index)


def test_two_choices_compute_their_prompt_once(serve: ServeFactory) -> None:
    served = serve(real_runtime(slots=2))
    engine: Any = served.model().engines[0]
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as client:
        # A prompt of two prefill steps (512 tokens each): the choices are admitted while
        # the first of them is still computing it.
        reply = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT_600}], max_tokens=2, n=2
        )
    body = reply.http_response.json()
    first, second = (served.recorder.by_id(c["request_id"]) for c in body["tokenbelt"]["choices"])
    assert first.prompt_tokens == second.prompt_tokens > 512
    # One choice computed the prompt (all but the chat template's head, which the engine
    # computed at load), the other waited for it and copied its cells.
    computed, copied = sorted([first.cached_tokens, second.cached_tokens])
    assert copied == first.prompt_tokens - 1
    assert 0 < computed < 64
    assert engine.statistics().prefix_hits == 2
    assert [c["index"] for c in body["choices"]] == [0, 1]
