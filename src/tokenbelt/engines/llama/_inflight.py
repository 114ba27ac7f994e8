"""The step llama.cpp is computing, and where a stop lands in it.

``StepInFlight`` owns the abort flag that llama.cpp's abort hook reads natively
(``_binding.py``: a ``strlen`` check between graph nodes, no GIL), the sequences of the
step in flight, and the stop watch thread. Its one rule (``_stop_locked``), for a
sequence stopped while its step runs:

- abort the step at once when every sequence in it is stopped, or when it carries the
  stopped sequence's own prompt chunk (nothing in it is worth finishing);
- else abort it at once when this engine's timings say it will run longer than
  ``stop_abort_after`` seconds more (waiting would only make the release later, for
  the same lost step: counted as ``stop_aborted_steps``);
- else let it end, unless it is still running ``stop_abort_after`` seconds from now:
  then the stop watch aborts it (a long step on a busy machine; counted the same).

An aborted step's cells are dropped by llama.cpp and every surviving sequence goes on
from where its KV ends: a stop never ends another stream, and costs it at most a step.

Threads: the loop calls ``begin``/``end`` around each ``llama_decode``; any thread calls
``stop`` (after setting the sequence's ``cancelled``), ``abort_if_alone`` (the thinking
deadline's timer) and ``abort`` (close); the stop watch is this object's own thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence as Seqs

from ._sequence import Sequence

logger = logging.getLogger("tokenbelt.engines.batch")


class StepInFlight:
    """The step in flight: its sequences, the native abort flag, the stop watch."""

    def __init__(self, name: str, stop_abort_after: float) -> None:
        self.name = name
        #: seconds a step may run on after a stop landed in it
        self.stop_abort_after = stop_abort_after
        #: read by the native abort hook: b"\x01" aborts the step in flight
        self.flag = ctypes.create_string_buffer(2)
        #: steps aborted by the stop watch or by the expected-length rule
        self.escalated = 0
        self._lock = threading.Lock()
        self._watch = threading.Condition(self._lock)
        self._seqs: list[Sequence] = []
        self._prefill: set[int] = set()  # ids of the sequences whose prompt is in it
        self._ends = 0.0  # when the step is expected to end (monotonic)
        self._abort_by: float | None = None  # when the stop watch aborts it, or None
        self._closed = False
        self.thread = threading.Thread(
            target=self._watch_stops, name=f"tokenbelt-stopwatch-{name}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    @property
    def running(self) -> bool:
        """Whether a step is in flight."""
        with self._lock:
            return bool(self._seqs)

    def begin(self, seqs: Seqs[Sequence], expected_s: float) -> None:
        """On the loop, before ``llama_decode``: this step computes ``seqs``, for about
        ``expected_s`` seconds. A sequence already stopped gets the rule at once."""
        with self._lock:
            self.flag[0] = b"\x00"
            self._seqs = list(seqs)
            self._prefill = {seq.id for seq in seqs if not seq.decoding}
            self._ends = time.monotonic() + expected_s
            self._abort_by = None
            for seq in self._seqs:
                if seq.cancelled:
                    self._stop_locked(seq)

    def end(self) -> None:
        """On the loop, after ``llama_decode``: the stop watch has nothing to abort."""
        with self._lock:
            self._seqs = []
            self._prefill = set()
            self._abort_by = None

    def stop(self, seq: Sequence) -> None:
        """On a cancelling thread, after ``seq.cancelled`` was set: the rule, if ``seq``
        is in the step in flight (else the loop leaves it out of the next one)."""
        with self._lock:
            if any(s is seq for s in self._seqs):
                self._stop_locked(seq)

    def abort_if_alone(self, seq: Sequence) -> None:
        """Abort the step in flight if it computes ``seq`` alone (a thinking deadline:
        a step shared with others runs on, so no one else pays)."""
        with self._lock:
            if len(self._seqs) == 1 and self._seqs[0] is seq:
                self.flag[0] = b"\x01"

    def abort(self) -> None:
        """Abort whatever step is in flight, and every later one until ``begin`` (close)."""
        with self._lock:
            self.flag[0] = b"\x01"

    def close(self) -> None:
        """End the stop watch (idempotent); the caller's loop has ended or is ending."""
        with self._lock:
            self._closed = True
            self._watch.notify()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()

    def _stop_locked(self, seq: Sequence) -> None:
        """THE stop rule (module docstring), under the lock."""
        if seq.id in self._prefill or all(s.cancelled for s in self._seqs):
            self.flag[0] = b"\x01"
            return
        now = time.monotonic()
        if self._ends - now > self.stop_abort_after:
            self._escalate()
            return
        if self._abort_by is None:
            self._abort_by = now + self.stop_abort_after
            self._watch.notify()

    def _escalate(self) -> None:
        if self.flag[0] == b"\x00":
            self.flag[0] = b"\x01"
            self.escalated += 1

    def _watch_stops(self) -> None:
        """The stop watch: a step that runs past its bound after a stop is aborted, so
        one long step never holds a stopped sequence (and no worker is killed for it)."""
        with self._watch:
            while not self._closed:
                due = self._abort_by
                if due is None:
                    self._watch.wait()
                    continue
                left = due - time.monotonic()
                if left > 0:
                    self._watch.wait(left)
                    continue
                self._abort_by = None
                if self._seqs and self.flag[0] == b"\x00":
                    self._escalate()
                    logger.debug(
                        "%s: a step ran %.0f ms past a stop: aborted",
                        self.name,
                        self.stop_abort_after * 1000,
                    )
