"""Structured output and tool calls through the official ``openai`` client, on the real model.

Every reply is constrained by a grammar, so it must parse and match its schema whatever
the small model would have written; a stop or a deadline inside a constrained stream
lands as fast as in a free one; a schema that cannot compile costs no compute.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anyio
import jsonschema
import openai
import pydantic
import pytest

import plainhttp
from tokenbelt import EndReason
from tokenbelt.belt import TraceEvent

from ..conftest import NET, Served, SharedServer, real_runtime, shared_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "enum": ["chess", "music", "sport", "books"]},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    f"Describe {who} as JSON."
    for who in (
        "a baker from Lyon",
        "an old sailor",
        "a young programmer",
        "my grandmother",
        "a football player",
        "a famous painter",
        "a student in Tokyo",
        "a farmer",
        "a pilot",
        "a teacher who loves books",
        "a chess champion",
        "a singer",
        "a doctor in Cairo",
        "a child",
        "a taxi driver",
        "a scientist",
        "a poet",
        "a chef",
        "an astronaut",
        "a librarian",
    )
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def person_format(schema: dict[str, Any] = PERSON) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    """One server for the module: its tests only send requests and read their own traces."""
    with shared_server(real_runtime) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


# -- structured output --------------------------------------------------------------------------


def test_json_schema_replies_validate_sync_and_async_stream_and_not(
    served: Served, client: openai.OpenAI
) -> None:
    model = served.model().name
    texts: list[str] = []
    for i, prompt in enumerate(PROMPTS[:5]):
        reply = client.chat.completions.create(
            model=model,
            messages=user(prompt),
            response_format=person_format(),
            seed=i,
            max_tokens=200,
        )
        assert reply.choices[0].finish_reason == "stop"
        texts.append(reply.choices[0].message.content or "")
    for i, prompt in enumerate(PROMPTS[5:10]):
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=user(prompt),
                response_format=person_format(),
                seed=i,
                max_tokens=200,
                stream=True,
            )
        )
        assert chunks[-1].choices[0].finish_reason == "stop"
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks))

    async def from_async() -> list[str]:
        found = []
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x") as aclient:
            for i, prompt in enumerate(PROMPTS[10:15]):
                reply = await aclient.chat.completions.create(
                    model=model,
                    messages=user(prompt),
                    response_format=person_format(),
                    seed=i,
                    max_tokens=200,
                )
                assert reply.choices[0].finish_reason == "stop"
                found.append(reply.choices[0].message.content or "")
            for i, prompt in enumerate(PROMPTS[15:20]):
                stream = await aclient.chat.completions.create(
                    model=model,
                    messages=user(prompt),
                    response_format=person_format(),
                    seed=i,
                    max_tokens=200,
                    stream=True,
                )
                parts = [c.choices[0].delta.content or "" async for c in stream]
                found.append("".join(parts))
        return found

    texts += anyio.run(from_async)
    assert len(texts) == 20
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_an_object(client: openai.OpenAI, served: Served) -> None:
    reply = client.chat.completions.create(
        model=served.model().name,
        messages=user("List three colours."),
        response_format={"type": "json_object"},
        max_tokens=300,
        seed=3,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_compile_time_is_reported_and_cached(client: openai.OpenAI, served: Served) -> None:
    schema = {**PERSON, "description": "a schema no other test uses"}
    infos = []
    for _ in range(2):
        reply = client.chat.completions.create(
            model=served.model().name,
            messages=user("Someone."),
            response_format=person_format(schema),
            max_tokens=1,
        )
        assert reply.choices[0].finish_reason == "length"  # cut short: the text as it is
        infos.append((reply.model_extra or {})["tokenbelt"]["grammar"])
    assert infos[0]["cached"] is False
    assert infos[0]["compile_ms"] > 0
    assert infos[1] == {"cached": True, "compile_ms": 0.0}


@pytest.mark.own_server  # the request list below is empty, not other tests' requests
def test_a_schema_that_cannot_compile_is_a_400_before_any_compute(
    client: openai.OpenAI, served: Served
) -> None:
    bad = [
        person_format({"type": "strange"}),
        person_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        person_format({"type": "string", "pattern": "(("}),
        # neither the grammar nor validation after the reply knows this format
        person_format({"type": "object", "properties": {"c": {"type": "string", "format": "x"}}}),
        person_format({"type": "integer", "minimum": 9, "maximum": 1}),  # no value fits
    ]
    for fmt in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=served.model().name, messages=user("hi"), response_format=fmt
            )
        assert caught.value.status_code == 400
        assert caught.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=served.model().name,
            messages=user("hi"),
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}],
        )
    assert caught.value.body["param"] == "tools"  # type: ignore[index]
    # Nothing was queued, admitted or decoded: no request was ever recorded.
    assert served.recorder.events == []
    assert plainhttp.get(f"{served.url}/v1/requests").json()["data"] == []


SIGNUP = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        "plan": {"type": "string", "enum": ["free", "pro"]},
    },
    "required": ["age", "email", "score", "plan"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_ranges_and_formats_are_enforced_and_the_reply_checked(
    client: openai.OpenAI, served: Served, stream: bool
) -> None:
    for seed in range(3):
        args: dict[str, Any] = {"model": served.model().name, "seed": seed, "max_tokens": 250}
        args.update(messages=user("Sign up Bob (bob@mail.com), age 999, score 42."))
        args.update(response_format=person_format(SIGNUP), stream=stream)
        if stream:
            chunks = list(client.chat.completions.create(**args))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            extension = (chunks[-1].model_extra or {})["tokenbelt"]
        else:
            reply = client.chat.completions.create(**args)
            text = reply.choices[0].message.content or ""
            extension = (reply.model_extra or {})["tokenbelt"]
        value = json.loads(text)
        assert 0 <= value["age"] <= 150  # asked for 999: the grammar held the range
        assert "@" in value["email"]
        # the fraction of a bounded number is checked after the reply, and reported
        check = extension["schema"]
        assert check["checked_after"] == [
            "exclusiveMinimum at properties.score",
            "exclusiveMaximum at properties.score",
        ]
        valid = 0 < value["score"] < 10
        assert check["validated"] is valid
        assert bool(check["errors"]) is not valid


# -- tool calls ---------------------------------------------------------------------------------


def assert_valid_call(name: str, arguments: str) -> None:
    assert name in PARAMS
    jsonschema.validate(json.loads(arguments), PARAMS[name])


QUESTIONS = [
    "What is the weather in Paris?",
    "How much is 12 plus 30?",
    "Is it raining in Oslo today?",
    "Tell me a joke.",
]


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_choices_always_yield_valid_calls(
    client: openai.OpenAI, served: Served, stream: bool
) -> None:
    model = served.model().name
    named = {"type": "function", "function": {"name": "add"}}
    for choice in ("required", named):
        for i, question in enumerate(QUESTIONS):
            args: dict[str, Any] = {"model": model, "messages": user(question), "seed": i}
            args.update(tools=TOOLS, tool_choice=choice, max_tokens=120)
            if not stream:
                reply = client.chat.completions.create(**args)
                assert reply.choices[0].finish_reason == "tool_calls"
                calls = reply.choices[0].message.tool_calls or []
                assert len(calls) == 1
                assert calls[0].id.startswith("call_")
                assert calls[0].type == "function"
                name, arguments = calls[0].function.name, calls[0].function.arguments  # type: ignore[union-attr]
            else:
                chunks = list(client.chat.completions.create(**args, stream=True))
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
                pieces = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
                assert pieces[0].id
                assert pieces[0].function
                assert pieces[0].function.name
                assert {p.index for p in pieces} == {0}
                name = pieces[0].function.name
                arguments = "".join((p.function.arguments or "") for p in pieces if p.function)
                assert len(pieces) > 2  # the arguments came in pieces
                assert all(not c.choices[0].delta.content for c in chunks)
            assert_valid_call(name, arguments)
            if choice is named:
                assert name == "add"


def test_auto_gives_text_or_a_valid_call(client: openai.OpenAI, served: Served) -> None:
    for i, question in enumerate(QUESTIONS):
        reply = client.chat.completions.create(
            model=served.model().name,
            messages=user(question),
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=80,
            seed=i,
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            fn = choice.message.tool_calls[0].function  # type: ignore[union-attr]
            assert_valid_call(fn.name, fn.arguments)
        else:
            assert choice.finish_reason in ("stop", "length")
            assert choice.message.content


def test_a_full_tool_round_trip(client: openai.OpenAI, served: Served) -> None:
    model = served.model().name
    messages: list[Any] = [
        {"role": "system", "content": "You are a weather assistant."},
        *user("What is the weather in Paris?"),
    ]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    assert_valid_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}
    )
    final = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=60
    )
    choice = final.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # The call and its result were part of the prompt: the same turns without them are
    # shorter by at least the result's own tokens.
    without = client.chat.completions.create(
        model=model, messages=messages[:2], tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert final.usage
    assert without.usage
    assert final.usage.prompt_tokens > without.usage.prompt_tokens + 10


def test_a_tool_message_needs_its_call_id(client: openai.OpenAI, served: Served) -> None:
    # A validation error: 422 here until request errors all become 400.
    with pytest.raises(
        (openai.BadRequestError, openai.UnprocessableEntityError), match="tool_call_id"
    ):
        client.chat.completions.create(
            model=served.model().name,
            messages=[*user("hi"), {"role": "tool", "content": "42"}],  # type: ignore[list-item]
        )


# -- stops and deadlines inside a constrained stream ---------------------------------------------

LONG = {
    "type": "object",
    "properties": {"numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 400}},
    "required": ["numbers"],
}


def cancel_counts(served: Served) -> dict[str, int]:
    """Completion tokens of each request at the moment its stop was requested."""
    counts: dict[str, int] = {}

    def observe(event: TraceEvent) -> None:
        if event.kind == "cancel_requested":
            counts[event.trace.request_id] = event.trace.completion_tokens

    served.runtime.subscribe(observe)
    return counts


def test_a_stop_inside_a_constrained_stream_lands_within_a_step(
    client: openai.OpenAI, served: Served
) -> None:
    counts = cancel_counts(served)
    stream = client.chat.completions.create(
        model=served.model().name,
        messages=user("Numbers."),
        response_format=person_format(LONG),
        max_tokens=2000,
        stream=True,
        extra_body={"tokenbelt": {"capacity": 4}},
    )
    for received, chunk in enumerate(stream, 1):
        if received == 10:
            request_id = chunk.id
            reply = plainhttp.post(f"{served.url}/v1/requests/{request_id}/cancel", timeout=NET)
            assert reply.json()["cancelled"] is True
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason.USER_CANCEL)
    assert trace.completion_tokens - counts[trace.request_id] <= 1
    assert trace.cancel_to_release is not None
    assert trace.cancel_to_release < 1.0
    assert (chunk.model_extra or {})["tokenbelt"]["end_reason"] == "user_cancel"


def test_a_deadline_inside_a_constrained_stream_lands_within_a_step(
    client: openai.OpenAI, served: Served
) -> None:
    counts = cancel_counts(served)
    chunks = list(
        client.chat.completions.create(
            model=served.model().name,
            messages=user("Numbers."),
            response_format=person_format(LONG),
            max_tokens=2000,
            stream=True,
            # Long enough for the grammar and the prompt on one core of a busy machine (a
            # test worker's share: 0.5 s ended some runs before the first token), far too
            # short for 2,000 tokens: the deadline lands inside the stream.
            extra_body={"tokenbelt": {"total_timeout": 2.0}},
        )
    )
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason.TOTAL_TIMEOUT)
    assert trace.completion_tokens - counts[trace.request_id] <= 1
    assert trace.cancel_to_release is not None
    assert trace.cancel_to_release < 1.0
    assert (chunks[-1].model_extra or {})["tokenbelt"]["end_reason"] == "total_timeout"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.startswith("{")
    assert not text.rstrip().endswith("}")


# -- response_format beside tools, and a call cut short ------------------------------------------

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_response_format_beside_tools_is_a_call_or_the_json(
    client: openai.OpenAI, served: Served
) -> None:
    model = served.model().name
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    kinds = set()
    for i, question in enumerate([*QUESTIONS, "Say hello.", "What is a cat?"]):
        reply = client.chat.completions.create(
            model=model,
            messages=user(question),
            tools=TOOLS,
            response_format=fmt,  # type: ignore[arg-type]
            max_tokens=120,
            seed=i,
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:
            fn = choice.message.tool_calls[0].function  # type: ignore[union-attr]
            assert_valid_call(fn.name, fn.arguments)
            assert choice.finish_reason == "tool_calls"
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(choice.message.content or ""), ANSWER)
            kinds.add("json")
        assert (reply.model_extra or {})["tokenbelt"]["schema"]["validated"] is True
    assert kinds  # which the small model picks is its own; each is whole
    for choice_, kind in (("required", "call"), ("none", "json")):
        reply = client.chat.completions.create(
            model=model,
            messages=user("Weather in Rome?"),
            tools=TOOLS,  # type: ignore[arg-type]
            response_format=fmt,
            tool_choice=choice_,
            max_tokens=120,  # type: ignore[arg-type]
        )
        message = reply.choices[0].message
        if kind == "call":
            assert message.tool_calls
        else:
            assert message.tool_calls is None
            jsonschema.validate(json.loads(message.content or ""), ANSWER)


@pytest.mark.parametrize("max_tokens", [3, 18, 30])
def test_a_cut_call_has_one_shape_streamed_or_not(
    client: openai.OpenAI, served: Served, max_tokens: int
) -> None:
    args: dict[str, Any] = {"model": served.model().name, "messages": user("Weather in Oslo?")}
    args.update(tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0)
    reply = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert reply.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
    message = reply.choices[0].message
    assert "<tool_call>" not in (message.content or "")
    assert all("tool_call" not in (c.choices[0].delta.content or "") for c in chunks)
    pieces = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    streamed = "".join((p.function.arguments or "") for p in pieces if p.function)
    calls = message.tool_calls or []
    if calls:  # the name was written: the call with the arguments as far as they went
        assert pieces[0].function
        assert calls[0].function.name == pieces[0].function.name  # type: ignore[union-attr]
        assert calls[0].function.arguments == streamed  # type: ignore[union-attr]
    else:
        assert pieces == []
    for extension in ((reply.model_extra or {})["tokenbelt"], chunks[-1].model_extra["tokenbelt"]):  # type: ignore[index]
        assert extension["tool_call_cut"] is True
        if calls:
            assert extension["schema"]["validated"] is False


# -- instructor: pydantic models with ranges, formats and literals --------------------------------


class Member(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=150)
    email: pydantic.EmailStr
    plan: Literal["free", "pro"]


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_gets_valid_models_and_the_range_holds(served: Served, mode: str) -> None:
    import instructor

    raw = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET)
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    with raw:
        for seed, text in enumerate(
            [
                "Ann, 34, ann@mail.com, on the pro plan.",
                "Sign up Bob (bob@mail.com), age 999, free plan.",  # out of range: held
            ]
        ):
            member = client.chat.completions.create(
                model=served.model().name,
                response_model=Member,
                messages=user(f"Extract the member: {text}"),
                max_retries=0,
                max_tokens=200,
                seed=seed,
            )
            assert isinstance(member, Member)  # pydantic validated it: ge, le, EmailStr, Literal
            assert 0 <= member.age <= 150
