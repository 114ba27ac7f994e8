"""The scripted engine: plays its script into a belt and honours every checkpoint."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tokenbelt import (
    DecodeError,
    EndOfStream,
    GenerationRequest,
    InvalidArgument,
    PromptTooLong,
    SamplingParams,
    ScriptedEngine,
)
from tokenbelt.belt import Belt, EndReason
from tokenbelt.engines import EngineStatistics, LoopEngine

NET = 5.0
LONG = 60.0  # a step far longer than any test may take: only a cancel can cut it short


def wait_until_blocked(
    thread: threading.Thread, inside: str, when: Callable[[], bool] = lambda: True
) -> None:
    """Wait until ``thread`` sleeps in a ``threading`` wait reached through ``inside``
    while ``when()`` holds (read the live stack; the timeout is a safety net)."""
    deadline = time.monotonic() + NET
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident or -1)
        if (
            when()
            and frame is not None
            and frame.f_code.co_name == "wait"
            and frame.f_code.co_filename == threading.__file__
        ):
            f: Any = frame
            while f is not None:
                if f.f_code.co_name == inside:
                    return
                f = f.f_back
        time.sleep(0.001)
    pytest.fail(f"{thread.name} never blocked inside {inside}()")


class Run:
    """One request of an engine on a producer thread."""

    def __init__(
        self, engine: ScriptedEngine, request: GenerationRequest, capacity: int = 4
    ) -> None:
        self.engine = engine
        self.belt: Belt[str] = Belt(capacity)
        self.thread = threading.Thread(
            target=self.belt.produce,
            args=(lambda b: engine.generate(request, b.producer),),
            name="test-scripted-producer",
            daemon=True,
        )
        self.thread.start()

    def read_all(self) -> tuple[list[str], EndReason]:
        items = []
        while True:
            try:
                items.append(self.belt.get())
            except EndOfStream as end:
                return items, end.reason

    def join(self) -> None:
        assert self.belt.wait_released(NET)
        self.thread.join(NET)
        assert not self.thread.is_alive()


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        if run.engine.gate is not None:
            run.engine.gate.set()
        run.belt.cancel(EndReason.SHUTDOWN)
        run.thread.join(NET)


def prompt(text: str = "hello there", max_tokens: int = 256) -> GenerationRequest:
    return GenerationRequest(prompt=text, sampling=SamplingParams(max_tokens=max_tokens))


def test_plays_the_script_and_stops(runs: list[Run]) -> None:
    engine = ScriptedEngine(["a", "b", "c"], delay=0)
    run = Run(engine, prompt("one two three"))
    runs.append(run)
    assert run.read_all() == (["a", "b", "c"], EndReason.STOP)
    run.join()
    trace = run.belt.trace
    assert trace.prompt_tokens == 3
    assert trace.completion_tokens == 3
    assert engine.tokens_computed == 3
    assert trace.end_reason is EndReason.STOP


def test_max_tokens_ends_with_length(runs: list[Run]) -> None:
    engine = ScriptedEngine(list("abcdef"), delay=0)
    run = Run(engine, prompt(max_tokens=2))
    runs.append(run)
    assert run.read_all() == (["a", "b"], EndReason.LENGTH)
    run.join()
    assert engine.tokens_computed == 2


def test_counts_chat_prompt_tokens(runs: list[Run]) -> None:
    request = GenerationRequest.chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi you"}]
    )
    run = Run(ScriptedEngine(["x"], delay=0), request)
    runs.append(run)
    run.read_all()
    run.join()
    assert run.belt.trace.prompt_tokens == 4


def test_failure_reaches_the_consumer_as_runtime_error(runs: list[Run]) -> None:
    run = Run(ScriptedEngine(list("abcd"), delay=0, fail_after=2), prompt())
    runs.append(run)
    assert run.belt.get() == "a"
    assert run.belt.get() == "b"
    with pytest.raises(DecodeError, match="after 2 tokens"):
        run.belt.get()
    run.join()
    assert run.belt.end_reason is EndReason.RUNTIME_ERROR
    assert run.belt.trace.error == "DecodeError: scripted failure after 2 tokens"


def test_computes_nothing_while_the_belt_is_full(runs: list[Run]) -> None:
    capacity = 2
    engine = ScriptedEngine([f"t{i}" for i in range(50)], delay=0)
    run = Run(engine, prompt(), capacity=capacity)
    runs.append(run)
    for consumed in range(5):
        full = lambda: run.belt.statistics().buffered == capacity  # noqa: E731
        wait_until_blocked(run.thread, "wait_for_room", when=full)
        # Blocked on a full belt, and not one token computed ahead of the room.
        assert engine.tokens_computed == consumed + capacity
        assert run.belt.get() == f"t{consumed}"
    run.belt.close()
    run.join()
    assert engine.tokens_computed <= 5 + capacity


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_cancel_cuts_a_long_step_short(runs: list[Run], phase: str) -> None:
    if phase == "prefill":
        engine = ScriptedEngine(["a"], prefill_delay=LONG)
    else:
        engine = ScriptedEngine(["a", "b"], delay=LONG)
    run = Run(engine, prompt(), capacity=4)
    runs.append(run)
    wait_until_blocked(run.thread, "generate")
    run.belt.cancel(EndReason.USER_CANCEL)
    run.join()  # well within the safety net, far from LONG
    assert run.belt.end_reason is EndReason.USER_CANCEL
    assert run.belt.trace.cancel_to_release is not None


def test_gate_stands_for_a_step_that_ignores_the_belt(runs: list[Run]) -> None:
    gate = threading.Event()
    engine = ScriptedEngine(["a", "b"], delay=0, gate=gate)
    run = Run(engine, prompt())
    runs.append(run)
    wait_until_blocked(run.thread, "generate")
    run.belt.cancel(EndReason.USER_CANCEL)
    # The step cannot be interrupted: the request is still held.
    assert not run.belt.wait_released(0)
    assert run.thread.is_alive()
    gate.set()
    run.join()  # the checkpoint after the step ends it
    assert engine.tokens_computed == 0
    assert run.belt.end_reason is EndReason.USER_CANCEL


def test_closed_engine_refuses_to_generate(runs: list[Run]) -> None:
    engine = ScriptedEngine(["a"])
    engine.close()
    run = Run(engine, prompt())
    runs.append(run)
    with pytest.raises(DecodeError, match="closed"):
        run.belt.get()
    run.join()


def test_prompt_too_long() -> None:
    engine = ScriptedEngine(["a"], context_length=3)
    with pytest.raises(PromptTooLong):
        engine.count_prompt_tokens(prompt("one two three"))
    assert engine.count_prompt_tokens(prompt("one two")) == 2


def test_from_text_keeps_leading_spaces() -> None:
    engine = ScriptedEngine.from_text("The quick  fox", delay=0)
    assert engine.tokens == ["The", " quick", " ", " fox"]
    assert "".join(engine.tokens) == "The quick  fox"
    assert engine.delay == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delay": -1},
        {"delay": float("nan")},
        {"prefill_delay": -0.5},
        {"prefill_delay": float("inf")},
        {"fail_after": -1},
    ],
    ids=repr,
)
def test_bad_engine_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument) as exc:
        ScriptedEngine(["a"], **kwargs)
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"max_tokens": True},
        {"max_tokens": 1.5},
        {"temperature": float("nan")},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -1},
        {"min_p": 2},
        {"repeat_penalty": 0},
        {"seed": -1},
        {"stop": [""]},
    ],
    ids=repr,
)
def test_bad_sampling_params(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument) as exc:
        SamplingParams(**kwargs)
    assert isinstance(exc.value, ValueError)


def test_sampling_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="###").stop == ("###",)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"prompt": "x", "messages": ({"role": "user", "content": "y"},)},
        {"messages": ({"role": "robot", "content": "y"},)},
        {"messages": ({"role": "user", "content": 3},)},
    ],
    ids=repr,
)
def test_bad_generation_requests(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        GenerationRequest(**kwargs)


def test_has_the_loop_shape_the_scheduler_drives() -> None:
    """``start`` never blocks: the script plays on a producer thread of its own, which
    records the end, runs the exit hook and then the release, as every engine does."""
    engine = ScriptedEngine(["a", "b"], delay=0)
    assert isinstance(engine, LoopEngine)
    assert engine.slots == 1
    belt: Belt[str] = Belt(8)
    exited = threading.Event()
    order: list[str] = []

    def on_exit() -> None:
        order.append("exit" if not belt.released else "exit after release")
        exited.set()

    engine.start(GenerationRequest(prompt="hi there"), belt.producer, on_exit)
    assert "".join(belt) == "ab"
    assert belt.wait_released(NET)
    assert exited.is_set()
    assert order == ["exit"]
    assert belt.end_reason is EndReason.STOP
    assert belt.trace.prompt_tokens == 2
    engine.close()
    assert engine.statistics() == EngineStatistics(slots=1, running=0)


def test_a_failure_on_the_loop_path_ends_runtime_error() -> None:
    engine = ScriptedEngine(["a", "b"], delay=0, fail_after=1)
    belt: Belt[str] = Belt(8)
    engine.start(GenerationRequest(prompt="hi"), belt.producer)
    with pytest.raises(DecodeError):
        "".join(belt)
    assert belt.wait_released(NET)
    assert belt.end_reason is EndReason.RUNTIME_ERROR
    engine.close()
