"""The supervision of a worker engine's processes, as the parent keeps it.

``Supervision`` owns what the parent knows of its workers over time: the engine's
``WorkerState``, why it failed, the restarts and when the next one is due (after the
crash history and backoff of ``_crashes.py``), each worker's load deadline, the
heartbeat, the grace of every stop, and the threads that failed; and it reports them
(``WorkerStatistics``). ``WorkerEngine`` (``_parent.py``) holds one and calls it under
its own lock: on a worker's spawn, ready and death, on a stop, and on every round of its
supervisor thread, which asks it what is due and does it (kills, a restart).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

from .._statistics import WorkerState, WorkerStatistics
from . import _messages as msg
from ._crashes import Crashes
from ._jobs import Job
from ._process import Process

logger = logging.getLogger("tokenbelt.engines.worker")

#: seconds between two heartbeats (a ``Ping`` the worker's loop answers between steps)
HEARTBEAT_S = 1.0
#: a worker that has answered no heartbeat for this long is not ready (``/health``)
HEARTBEAT_BOUND_S = 5.0


class Supervision:
    """The state of one engine's workers and what its supervisor does about it.

    What changes it runs under the engine's lock (``spawned`` before the new worker is
    the engine's, seen by no other thread yet); the kills (``kill_late``, ``kill_slow``)
    run after the supervisor thread let go of the lock, and ``statistics`` reads
    without it.
    """

    def __init__(
        self, *, stop_grace: float, load_timeout: float | None, max_load_crashes: int
    ) -> None:
        self.stop_grace = stop_grace
        self.load_timeout = load_timeout
        self.state = WorkerState.STARTING
        #: why the engine failed (workers kept dying while loading), or None
        self.failure: str | None = None
        #: workers started after the first
        self.restarts = 0
        #: times one of the engine's threads failed and was started again
        self.thread_failures = 0
        self.crashes = Crashes(max_load_crashes)
        self._restart_at: float | None = None
        self._next_ping = 0.0
        self._pings = itertools.count(1)

    # -- a worker's life ---------------------------------------------------------------------

    def spawned(self, w: Process) -> None:
        """A worker started: its load deadline runs from now."""
        if self.load_timeout is not None:
            w.load_by = time.monotonic() + self.load_timeout

    def ready(self, w: Process, *, current: bool) -> bool:
        """``w`` said it is ready: the engine loads after all. True when it is the
        ``current`` worker: then the engine is ready and the heartbeat starts."""
        w.became_ready = True
        w.answered_at = time.monotonic()
        w.load_by = None
        self.crashes.loaded()
        if not current:
            return False
        self.state = WorkerState.READY
        self._next_ping = 0.0
        return True

    def answered(self, w: Process) -> None:
        """``w`` answered a heartbeat."""
        w.answered_at = time.monotonic()

    def crashed(self, w: Process, cause: str, *, current: bool) -> str | None:
        """``w`` died of ``cause``. When it was the ``current`` worker: the next one is
        due after the backoff, or, when workers kept dying before they were ready, the
        engine fails: returns why (then call ``fail``)."""
        self.crashes.record(cause, was_ready=w.became_ready)
        if not current:
            return None
        if self.crashes.load_failed:
            return (
                f"the engine worker died {self.crashes.while_loading} times in a row before "
                f"it was ready; the last time: {w.load_error or cause}"
            )
        self.state = WorkerState.RESTARTING
        self._restart_at = time.monotonic() + self.crashes.backoff()
        return None

    def restarting(self) -> None:
        """The next worker starts now."""
        self.restarts += 1
        self.state = WorkerState.STARTING

    def fail(self, failure: str, *, crash: bool = False) -> None:
        """No worker can serve: the engine fails with ``failure`` (with ``crash``, the
        latest crash's cause too: no worker could even be started)."""
        if crash:
            self.crashes.last = failure
        self.state = WorkerState.FAILED
        self.failure = failure

    def close(self) -> None:
        self.state = WorkerState.CLOSED

    # -- stops -------------------------------------------------------------------------------

    def arm_stop(self, job: Job) -> None:
        """``job`` was stopped: its worker must let it go within the grace."""
        job.stop_by = time.monotonic() + self.stop_grace

    def kill_late(self, job: Job) -> None:
        """Kill the worker that kept ``job`` past its stop's grace (the trace says so)."""
        w = job.worker
        if w is None or w.done:
            return
        cause = f"engine worker killed: a stop was not honoured within {self.stop_grace} s"
        job.record_kill(w, cause)
        logger.warning("request %s: %s", job.producer.trace.request_id, cause)
        w.kill(cause)

    # -- the supervisor's round --------------------------------------------------------------

    def due(self, w: Process, jobs: Iterable[Job], now: float) -> tuple[list[Job], bool, bool]:
        """What is due at ``now`` for the current worker ``w`` and the engine's ``jobs``:
        the jobs whose stop's grace ran out (each is returned once), whether ``w``'s load
        took too long (once) and whether the next worker is to start (once). Sends the
        heartbeat's ``Ping`` when it is due."""
        late = [
            j for j in jobs if j.stop_by is not None and j.stop_by <= now and j.worker is not None
        ]
        for j in late:
            j.stop_by = None
        slow_load = w.load_by is not None and w.load_by <= now and not w.done
        if slow_load:
            w.load_by = None  # killed once
            w.load_expired = True
        restart = self._restart_at is not None and self._restart_at <= now
        if restart:
            self._restart_at = None
        if self._beating(w) and self._next_ping <= now:
            self._next_ping = now + HEARTBEAT_S
            w.post(msg.Ping(next(self._pings)))
        return late, slow_load, restart

    def wakes(self, w: Process, jobs: Iterable[Job]) -> list[float]:
        """When something will be due (monotonic; none: nothing until the engine changes)."""
        times = [j.stop_by for j in jobs if j.stop_by is not None]
        times += [t for t in (self._restart_at, w.load_by) if t is not None]
        if self._beating(w):
            times.append(self._next_ping)
        return times

    def kill_slow(self, w: Process) -> None:
        w.kill(f"engine worker killed: loading took longer than {self.load_timeout} s")

    def _beating(self, w: Process) -> bool:
        return self.state is WorkerState.READY and not w.done

    # -- the report --------------------------------------------------------------------------

    def statistics(self, w: Process, *, running: bool) -> WorkerStatistics:
        """The snapshot, with ``w`` the current worker (``running``: it has not ended
        and the engine is open)."""
        silent = None
        if running and self.state is WorkerState.READY and w.answered_at is not None:
            silent = time.monotonic() - w.answered_at
        return WorkerStatistics(
            state=self.state.value,
            pid=w.pid if running else None,
            restarts=self.restarts,
            last_crash=self.crashes.last,
            rss_bytes=w.rss() if running else None,
            failure=self.failure,
            thread_failures=self.thread_failures,
            unresponsive_s=(
                round(silent, 3) if silent is not None and silent > HEARTBEAT_BOUND_S else None
            ),
        )
