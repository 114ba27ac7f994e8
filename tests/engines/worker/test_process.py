"""The parent's end of a worker's pipe: writes that never block the caller, in order.

A real socket pair and a real (finished) child process; no model.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from tokenbelt.belt import EndReason
from tokenbelt.engines import GenerationRequest
from tokenbelt.engines.worker._messages import Cancel, Credit, Start
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
        assert far.recv() == Credit(7, 4)
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
        assert far.recv() == big
        assert far.recv() == stop
        assert grants == ["job"]
        with w.cond:
            w.done = True
            w.cond.notify_all()
        sender.join(5)
        assert not sender.is_alive()
    finally:
        w.close_pipe()
        far.close()
