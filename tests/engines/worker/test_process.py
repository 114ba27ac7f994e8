"""The parent's end of a worker's pipe: writes that never block the caller, in order.

A real socket pair and a real (finished) child process; no model.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, cast

import pytest

from tokenbelt.belt import EndReason
from tokenbelt.engines import GenerationRequest
from tokenbelt.engines.worker._messages import Cancel, Credit, Start, decode
from tokenbelt.engines.worker._process import Process


def _pipe() -> tuple[Process, Connection]:
    import socket

    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return Process(child, ours, 1), Connection(theirs.detach())


def test_a_message_the_pipe_takes_is_written_on_the_callers_thread() -> None:
    w, far = _pipe()
    try:
        w.post(Credit(7, 4))
        assert not w.outbox  # nothing left for the sender thread
        assert far.poll(1)
        assert decode(far.recv()) == Credit(7, 4)
    finally:
        w.close_pipe()
        far.close()


def test_what_the_pipe_does_not_take_waits_for_the_sender_and_the_order_holds() -> None:
    """A message bigger than the socket's buffer: ``post`` returns at once (the far end
    reads nothing yet), keeps the rest and everything after it for the sender thread,
    which writes them whole and in order once the far end reads."""
    w, far = _pipe()
    big = Start(1, "req", GenerationRequest(prompt="x" * (8 << 20)), 8, None)
    stop = Cancel(1, EndReason.USER_CANCEL)
    grants: list[Any] = []
    try:
        began = time.monotonic()
        w.post(big)
        w.defer(lambda: grants.append("job"))
        w.post(stop)
        assert time.monotonic() - began < 1.0
        assert len(w.outbox) == 3  # the unsent part, the grant, the stop
        sender = threading.Thread(target=w.send_queued, daemon=True)
        sender.start()
        assert decode(far.recv()) == big
        assert decode(far.recv()) == stop
        assert grants == ["job"]
        with w.cond:
            w.done = True
            w.cond.notify_all()
        sender.join(5)
        assert not sender.is_alive()
    finally:
        w.close_pipe()
        far.close()


def test_every_message_kind_survives_the_pipe_whole() -> None:
    """Each record, framed by the parent or sent by the child's ``Connection``, reads
    back as the same record (the kinds are numbered by their place)."""
    from multiprocessing.connection import Pipe

    from tokenbelt.engines import BatchStatistics
    from tokenbelt.engines.worker import _messages as m

    request = GenerationRequest(prompt="hi")
    stats = BatchStatistics(2, 1, 3, 4, 5, 0, 1, 2, 1, 2)
    every = [
        m.Load("model.gguf", {"slots": 2}, None),
        m.Start(1, "req", request, 8, [1, 2]),
        m.Credit(1, 4),
        m.Close(),
        m.Cancel(1, EndReason.USER_CANCEL),
        m.Ready({"pid": 1}),
        m.LoadError("no"),
        m.Admit(1),
        m.Prompt(1, 5),
        m.Cached(1, 3),
        m.Item(1, " hi", 1),
        m.Finish(1, EndReason.STOP, 2, "\n"),
        m.Fail(1, "boom", 0),
        m.Release(1, ["req_2"], stats),
        m.Step((m.Item(1, " a", 1), m.Item(2, " b", 1), m.Release(2, [], None))),
    ]
    ours, theirs = Pipe()
    try:
        for message in every:
            theirs.send(m.encode(message))
            assert m.decode(ours.recv()) == message
    finally:
        ours.close()
        theirs.close()


def test_a_step_sampled_while_held_crosses_as_one_frame_in_order() -> None:
    """The worker's link holds what the sampling thread sends during a step and writes it
    as one frame at the step's end; a message another thread sends meanwhile goes after
    what was held, so the pipe keeps the order of the sends."""
    from multiprocessing.connection import Pipe

    from tokenbelt.engines.worker import _messages as m
    from tokenbelt.engines.worker._child import _Link

    ours, theirs = Pipe()
    link = _Link(theirs)
    try:
        with link.held():
            link.send(m.Item(1, " a", 1))
            link.send(m.Item(2, " b", 1))
            assert not ours.poll(0.05), "nothing is written while the step samples"
            other = threading.Thread(target=link.send, args=(m.Cancel(3, EndReason.TOTAL_TIMEOUT),))
            other.start()
            other.join(5)
            link.send(m.Finish(1, EndReason.STOP, 0, None))
        frames = [m.messages(ours.recv()) for _ in range(3)]
        assert frames == [
            [m.Item(1, " a", 1), m.Item(2, " b", 1)],
            [m.Cancel(3, EndReason.TOTAL_TIMEOUT)],
            [m.Finish(1, EndReason.STOP, 0, None)],
        ]
        assert not ours.poll(0.05)
        link.send(m.Item(1, " c", 1))  # outside a step: written at once, alone
        assert m.messages(ours.recv()) == [m.Item(1, " c", 1)]
    finally:
        ours.close()
        theirs.close()


def test_tokens_sampled_after_a_cancel_reach_the_parent_with_the_release() -> None:
    """A cancel carries no token count: the worker's producer sends the tokens it counted
    since its last item with the release, so the parent's completion count is the
    engine's (a thinking model's reasoning count would otherwise exceed it)."""
    from multiprocessing.connection import Pipe

    from tokenbelt.engines.worker import _messages as m
    from tokenbelt.engines.worker._child import _Forward, _Link

    ours, theirs = Pipe()
    producer = _Forward(_Link(theirs), 1, "req", 4, None)
    try:
        producer.count_token()
        producer.put_nowait(" a")
        producer.count_token()  # sampled while the parent's cancel was on its way
        producer.stop(EndReason.TOTAL_TIMEOUT)
        producer.count_token()
        producer.release()
        sent = [m.decode(ours.recv()) for _ in range(2)]
        assert sent[0] == m.Item(1, " a", 1)
        assert isinstance(sent[1], m.Release)
        assert sent[1].tokens == 2
    finally:
        ours.close()
        theirs.close()


def _switches(tid: int) -> int:
    """How often thread ``tid`` of this process went to sleep (Linux's count)."""
    with open(f"/proc/self/task/{tid}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def _wakes_while(tid: list[int], far: Connection, write: Any, n: int = 200) -> int:
    """How often the waiting thread ``tid[0]`` woke while ``n`` frames written by
    ``write()`` were taken one at a time at the far end (nothing arrives for it)."""
    deadline = time.monotonic() + 5
    while not tid and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # asleep, waiting for input
    before = _switches(tid[0])
    for _ in range(n):
        write()
        far.recv()
    return _switches(tid[0]) - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's switch counts")
def test_the_readers_sleep_through_the_far_end_taking_their_writes() -> None:
    """A thread blocked reading a Unix socket is woken each time the far end takes
    something written on that socket (room to write again): the worker's reader was,
    once a token, on the cores llama.cpp's threads use, and the parent's for each
    credit. Both wait for input in ``poll``, which wakes only for input."""
    import socket

    from tokenbelt.engines.worker import _messages as m
    from tokenbelt.engines.worker._child import _Link, _Worker

    ours, theirs = socket.socketpair()
    link = _Link(Connection(theirs.detach()))
    far = Connection(ours.detach())
    tid: list[int] = []

    def serve() -> None:
        tid.append(threading.get_native_id())
        _Worker(link, cast(Any, None), None).serve()

    worker = threading.Thread(target=serve)
    worker.start()
    try:
        wakes = _wakes_while(tid, far, lambda: link.send(m.Item(1, " a", 1)))
        far.send(m.encode(m.Close()))
        worker.join(5)
        assert wakes < 20, f"the worker's reader woke {wakes} times for 200 frames"
    finally:
        link.conn.close()
        far.close()

    w, far = _pipe()
    tid.clear()

    def read() -> None:
        tid.append(threading.get_native_id())
        w.read(lambda message: None)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        wakes = _wakes_while(tid, far, lambda: w.post(Credit(1, 4)))
        far.close()
        reader.join(5)
        assert wakes < 20, f"the parent's reader woke {wakes} times for 200 credits"
    finally:
        w.close_pipe()
        far.close()
