"""``Runtime.drain`` and ``close``: stop admitting, end every request with ``shutdown``,
wait (bounded) for every release."""

from __future__ import annotations

import threading

import pytest

from tokenbelt import EndReason, GenerationRequest, Runtime, RuntimeClosed, ScriptedEngine
from tokenbelt.belt import Producer

from . import NET, Recorder, words


def test_drain_ends_running_and_queued_requests_and_refuses_new_ones() -> None:
    recorder = Recorder()
    rt = Runtime(keep_alive=None, observers=[recorder])
    try:
        model = rt.add_engines("scripted", [ScriptedEngine(words(100_000), delay=0.001)])
        running = model.stream(prompt="one")
        queued = model.stream(prompt="two")
        pieces = iter(running)  # kept: dropping a reader stops its request
        assert next(pieces)  # the first one produces; the second waits its turn
        assert model.statistics().queued == 1

        assert rt.drain(NET) is True

        for stream in (running, queued):
            assert stream.end_reason is EndReason.SHUTDOWN
            assert stream.trace.released is not None
        assert queued.trace.admitted is None
        with pytest.raises(RuntimeClosed, match="shutting down"):
            model.stream(prompt="three")
        with pytest.raises(RuntimeClosed):
            rt.add_engines("other", [ScriptedEngine(words(1))])
    finally:
        rt.close()


class OneLongStep(ScriptedEngine):
    """One native step that cannot see a cancel: it returns when ``done`` is set."""

    def __init__(self) -> None:
        super().__init__(["x"])
        self.inside = threading.Event()
        self.done = threading.Event()

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        self.inside.set()
        self.done.wait(NET)
        producer.checkpoint()
        return EndReason.STOP


def test_drain_says_when_a_release_outlasts_its_timeout() -> None:
    engine = OneLongStep()
    rt = Runtime(keep_alive=None)
    try:
        model = rt.add_engines("stuck", [engine])
        stream = model.stream(prompt="hi")
        assert engine.inside.wait(NET)
        assert rt.drain(0.1) is False
        assert stream.end_reason is EndReason.SHUTDOWN
        assert stream.trace.released is None
        engine.done.set()
        assert stream.wait_released(NET)
    finally:
        engine.done.set()
        rt.close()


def test_close_is_drain_then_unload() -> None:
    engine = ScriptedEngine(words(100_000), delay=0.001)
    rt = Runtime(keep_alive=None)
    model = rt.add_engines("scripted", [engine])
    stream = model.stream(prompt="hi")
    pieces = iter(stream)
    assert next(pieces)
    rt.close(timeout=NET)
    assert stream.end_reason is EndReason.SHUTDOWN
    assert stream.trace.released is not None
    assert engine.closed
    assert rt.models == {}
