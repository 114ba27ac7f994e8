"""The worker parent's reader thread, made to fail once, says so and is started again.

A real worker process with the default model: its crash is seen by the reader, whose
handling of it fails once here; the failure is logged and counted, the reader starts
again, sees the crash after all, and the next worker serves.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import pytest

from tokenbelt import EndReason, Runtime
from tokenbelt.engines import WorkerEngine
from tokenbelt.models import default_model_path

from . import wait_until

pytestmark = pytest.mark.model

HELLO = [{"role": "user", "content": "Say hello."}]


def test_a_reader_that_fails_is_logged_counted_and_started_again(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Runtime(keep_alive=None, n_ctx=512, slots=1, isolation="process") as rt:
        model = rt.load(str(default_model_path()))
        engine = model.engines[0]
        assert isinstance(engine, WorkerEngine)
        real_gone = engine._gone
        failed: list[bool] = []

        def gone(*args: Any) -> None:
            if not failed:  # before it records anything of the crash
                failed.append(True)
                raise RuntimeError("the crash handling failed")
            real_gone(*args)

        monkeypatch.setattr(engine, "_gone", gone)
        pid = engine.pid
        assert pid is not None
        with caplog.at_level(logging.ERROR, logger="tokenbelt.engines.worker"):
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: engine.worker_statistics().restarts == 1, "the restart")
        stats = engine.worker_statistics()
        assert stats.thread_failures == 1
        assert stats.last_crash == "engine worker killed by signal 9 (SIGKILL)"
        failures = [r for r in caplog.records if "the read thread of" in r.getMessage()]
        assert len(failures) == 1
        assert failures[0].exc_info is not None
        reply = model.complete(HELLO, max_tokens=4, temperature=0.0)
        assert reply.end_reason is EndReason.LENGTH
        assert engine.pid not in (None, pid)
