"""Chat sessions: which turns join the conversation, undo, one turn at a time, sync and async.

The scripted engine counts a prompt as one token per word of every message, so a turn's
``usage.prompt_tokens`` shows exactly which history the engine was sent. Its script is
long; a session turn stops after two tokens (``max_tokens=2``, a natural ``length`` end),
and a turn meant to be cancelled asks for many: backpressure keeps it from finishing
before the reader stops, whatever the timing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenbelt import (
    ChatSession,
    DecodeError,
    EndReason,
    IllegalState,
    InvalidArgument,
    Limits,
    Model,
    Runtime,
    ScriptedEngine,
)

from . import NET, words

SYSTEM = "Be brief."  # 2 words
REPLY = ["Sure", " thing."]  # "Sure thing.": 2 words
SCRIPT = REPLY + words(500)
#: more tokens than the belt holds: the turn cannot end before its reader lets it
LONG_TURN = 200


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(SCRIPT, delay=0)


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = Runtime(keep_alive=None)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture
def model(runtime: Runtime, engine: ScriptedEngine) -> Model:
    return runtime.add_engines("scripted", [engine])


@pytest.fixture
def chat(model: Model) -> Iterator[ChatSession]:
    with model.chat(system=SYSTEM, max_tokens=2) as session:
        yield session


def turn(user: str, reply: str = "Sure thing.") -> list[dict[str, str]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


SYSTEM_MESSAGE = [{"role": "system", "content": SYSTEM}]


def test_a_completed_turn_joins_the_history(chat: ChatSession) -> None:
    reply = chat.send("hello there")
    assert reply.text == "Sure thing."
    assert reply.end_reason is EndReason.LENGTH
    assert reply.finish_reason == "length"
    assert reply.usage.prompt_tokens == 2 + 2
    assert reply.usage.completion_tokens == 2
    assert reply.usage.total_tokens == 6
    assert reply.usage.to_dict() == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert chat.history == SYSTEM_MESSAGE + turn("hello there")

    second = chat.send("tell me more")
    # system + first turn + the new message: the engine saw the whole conversation
    assert second.usage.prompt_tokens == 2 + 2 + 2 + 3
    assert chat.history == SYSTEM_MESSAGE + turn("hello there") + turn("tell me more")


def test_history_is_a_copy(chat: ChatSession) -> None:
    chat.send("hi")
    copy = chat.history
    copy.clear()
    assert len(chat.history) == 3


def test_a_cancelled_turn_is_not_added(chat: ChatSession) -> None:
    chat.send("hello there")
    stream = chat.stream("interrupt me", max_tokens=LONG_TURN)
    for piece in stream:
        assert piece == "Sure"
        break
    assert stream.end_reason is EndReason.USER_CANCEL
    assert stream.wait_released(NET)
    assert stream.reply().finish_reason == "stop"
    assert chat.history == SYSTEM_MESSAGE + turn("hello there")

    after = chat.send("again")
    assert after.usage.prompt_tokens == 2 + 2 + 2 + 1  # the cancelled turn was not sent
    assert chat.history == SYSTEM_MESSAGE + turn("hello there") + turn("again")


def test_a_timed_out_turn_is_not_added(runtime: Runtime) -> None:
    session = runtime.add_engines("slow", [ScriptedEngine(REPLY, prefill_delay=60)]).chat()
    reply = session.send("hi", limits=Limits(first_token=0.05))
    assert reply.end_reason is EndReason.FIRST_TOKEN_TIMEOUT
    assert reply.text == ""
    assert session.history == []


def test_a_failed_turn_reraises_and_is_not_added(chat: ChatSession, engine: ScriptedEngine) -> None:
    chat.send("hello there")
    engine.fail_after = 1

    with pytest.raises(DecodeError, match="scripted failure"):
        chat.send("break please")
    assert chat.history == SYSTEM_MESSAGE + turn("hello there")

    stream = chat.stream("break again")
    read: list[str] = []
    with pytest.raises(DecodeError):
        read.extend(stream)
    assert read == ["Sure"]  # what came before the failure is delivered first
    assert stream.end_reason is EndReason.RUNTIME_ERROR
    assert stream.trace.error is not None
    assert stream.trace.error.startswith("DecodeError")
    assert stream.reply().finish_reason == "length"
    assert chat.history == SYSTEM_MESSAGE + turn("hello there")

    engine.fail_after = None
    assert chat.send("fine now").usage.prompt_tokens == 2 + 2 + 2 + 2


def test_undo_removes_the_last_completed_turn(chat: ChatSession) -> None:
    chat.send("one")
    chat.send("two")
    removed = chat.undo()
    assert removed == turn("two")
    assert chat.history == SYSTEM_MESSAGE + turn("one")
    assert chat.undo() == turn("one")
    assert chat.history == SYSTEM_MESSAGE
    assert chat.undo() == []  # the system message stays
    assert chat.history == SYSTEM_MESSAGE
    assert chat.send("three").usage.prompt_tokens == 2 + 1


def test_one_turn_at_a_time(chat: ChatSession) -> None:
    stream = chat.stream("first", max_tokens=LONG_TURN)
    with pytest.raises(IllegalState, match="still running"):
        chat.stream("second")
    assert len(list(stream)) == LONG_TURN
    assert stream.end_reason is EndReason.LENGTH
    assert chat.send("second").text == "Sure thing."
    assert len(chat.history) == 1 + 2 + 2


def test_leaving_the_session_cancels_its_running_turn(model: Model) -> None:
    with model.chat() as chat:
        stream = chat.stream("hi", max_tokens=LONG_TURN)
        pieces = iter(stream)  # kept: dropping it would cancel the turn by itself
        assert next(pieces) == "Sure"
        assert stream.end_reason is None
    assert stream.end_reason is EndReason.USER_CANCEL
    assert stream.wait_released(NET)
    assert chat.history == []


def test_bad_arguments_are_rejected_before_any_request(model: Model) -> None:
    with pytest.raises(InvalidArgument):
        model.chat(temperature=-1)
    with pytest.raises(InvalidArgument, match="unknown sampling"):
        model.chat(frequency_penalty_typo=1.0)
    with model.chat() as chat:
        with pytest.raises(InvalidArgument, match="string"):
            chat.send(42)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            chat.send("hi", top_p=0)
        assert chat.history == []
    assert model.statistics().queue_peak == 0


@pytest.mark.anyio
async def test_async_session(model: Model) -> None:
    async with model.achat(system=SYSTEM, max_tokens=2) as chat:
        reply = await chat.asend("hello there")
        assert reply.text == "Sure thing."
        stream = chat.astream("more")
        assert [p async for p in stream] == REPLY
        assert stream.end_reason is EndReason.LENGTH
        assert chat.history == SYSTEM_MESSAGE + turn("hello there") + turn("more")

        cancelled = chat.astream("stop me", max_tokens=LONG_TURN)
        async for _ in cancelled:
            cancelled.cancel()
        assert cancelled.end_reason is EndReason.USER_CANCEL
        assert await cancelled.await_released(NET)
        assert len(chat.history) == 5
