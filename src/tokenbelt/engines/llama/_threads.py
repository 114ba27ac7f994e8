"""Thread counts for llama.cpp, chosen for the cores this process may use.

llama-cpp-python defaults to half the cores for decoding and all of them for
prompts. Measured on a 2-core machine with the default model (``benchmarks/batch.py``
sweeps the counts): decoding with 2 threads ran ~1.9x the rate of 1 thread, so
half the cores leaves about half the machine unused. tokenbelt uses every core
this process is allowed to run on (its CPU affinity, so a container or a
``taskset`` limit is respected) for both.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
from collections import deque
from typing import Any

from ..._errors import InvalidArgument
from ...belt import check

logger = logging.getLogger("tokenbelt.engines.batch")

#: samples of a step's cost kept per kind and thread count; the cost is their median
WINDOW = 9
#: the count in use stays unless another one is this much cheaper (a fraction)
SWITCH_MARGIN = 0.05


def usable_cores() -> int:
    """The cores this process may run on (CPU affinity where the OS has it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def default_threads() -> tuple[int, int]:
    """(decode threads, prompt threads) for this machine."""
    cores = usable_cores()
    return cores, cores


def thread_candidates(cores: int, load: float | None = None) -> list[int]:
    """The thread counts the tuner picks from: all cores, one fewer, half.

    Tried in this order (the most first), unless ``load`` (the system's load average)
    says the cores are busy already: then the fewest first, since a first try with
    every core costs seconds on a busy machine.
    """
    counts = sorted({cores, max(1, cores - 1), max(1, cores // 2)}, reverse=True)
    if load is not None and load >= cores:
        counts.reverse()
    return counts


def check_threads(name: str, value: int | None) -> int | None:
    """Reject a thread count that is not an integer from 1 to 4x this machine's CPUs.

    llama.cpp (its OpenMP runtime) crashes the process when it cannot create the
    threads asked for, so an absurd count is refused here, with a reason.
    """
    if value is None:
        return None
    return int(check("threads", value, label=name))


def check_decode_nice(value: int) -> int:
    """Reject a ``decode_nice`` outside 0 to 19, or above 0 where a thread's niceness is
    not its own (only Linux has it)."""
    nice = int(check("decode_nice", value))
    if nice and sys.platform != "linux":
        raise InvalidArgument(
            f"decode_nice is Linux only (a thread's own priority), got {nice}; use 0 here"
        )
    return nice


def lower_this_thread(nice: int) -> None:
    """Make the calling thread ``nice`` nicer than it is now (at most 19).

    Called by the engine thread before its first step: the threads llama.cpp's OpenMP
    runtime starts from it inherit the niceness, so the whole decode yields a core to a
    thread of the process that has a token to deliver; the other threads keep theirs.
    """
    if nice <= 0:
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # a sandbox that forbids it: the decode keeps its priority
        logger.warning("the decode threads keep the process's priority: %s", exc)


def set_threads(lib: Any, ctx: Any, threads: int, current: int) -> int:
    """Give a llama.cpp context ``threads`` for its next step, unless it has them
    (``current``); returns the count it has now.

    Only on a change: each call logs a line through the binding's log callback, a trip
    into Python that cost a lone stream about 35 us a step (0.5% of the default model's).
    """
    if threads != current:
        lib.llama_set_n_threads(ctx, threads, threads)
    return threads


def system_load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return None


class ThreadTuner:
    """Chooses llama.cpp's thread count for each step from the step times it measures.

    Why: llama.cpp's threads meet at a barrier after every operation and spin while
    they wait. With every core in use, one busy neighbour process that takes a core
    stalls every barrier: measured on 2 cores with a neighbour, a 256-token prompt
    took 5.5-10.8 s with 2 threads and 2.9 s with 1, and decoding fell from ~50 to
    5-12 tokens/s. Alone, 2 threads decode ~1.9x faster than 1.

    Each kind of step (``decode``: a few tokens; ``prefill``: a prompt chunk; an
    embedding ubatch by its size, see ``embed_kind``) keeps its cost per thread count
    (seconds per step for decode, per token for the others): the median of its last
    ``WINDOW`` samples. A moving average let one slow step (a page fault, the event
    loop taking a core for a moment) lift the used count over the other's stale cost:
    a lone stream of the default model then spent long runs on 1 thread, 7.0-7.2 ms a
    token against 6.1-6.7 on 2 (llama.cpp's own server: 6.1-6.4). A sample under half
    the median means the machine changed (a neighbour left): it replaces the window.
    The cheapest count is used (the one in use stays while the other is within
    ``SWITCH_MARGIN`` of it); every ``explore_every`` steps one
    other count is tried, so a neighbour that leaves is noticed too. A count that
    was over 1.5x worse when tried is tried half as often each time (down to once in
    512 steps), so exploring costs a quiet machine well under 1% of its steps.
    """

    def __init__(self, candidates: list[int], *, explore_every: int = 32) -> None:
        self.candidates = candidates
        self._explore_every = explore_every
        self._cost: dict[str, dict[int, float]] = {}
        self._samples: dict[tuple[str, int], deque[float]] = {}
        self._steps: dict[str, int] = {}
        self._interval: dict[str, int] = {}
        self._turn = 0
        self._held: dict[str, int] = {}  # the count each kind uses (not exploring)
        #: the count chosen for the latest step
        self.current = candidates[0]

    def _costs(self, kind: str) -> dict[int, float]:
        return self._cost.setdefault(kind, {})

    def best(self, kind: str) -> int:
        """The cheapest count; the one in use keeps its place unless another is
        ``SWITCH_MARGIN`` cheaper (close costs swap places from sample to sample)."""
        costs = self._costs(kind)
        known = [c for c in self.candidates if c in costs]
        if not known:
            return self.candidates[0]
        cheapest = min(known, key=costs.__getitem__)
        held = self._held.get(kind)
        if held in costs and costs[cheapest] > (1 - SWITCH_MARGIN) * costs[held]:
            return held
        return cheapest

    def choose(self, kind: str) -> int:
        """The count for the next step of ``kind``. A count not tried yet waits for the
        kind's first exploring turn, as any other: tried at once, it ran the second
        prompt after a start (the first request after a readiness probe) on 1 thread."""
        costs = self._costs(kind)
        steps = self._steps[kind] = self._steps.get(kind, 0) + 1
        choice = self._held[kind] = self.best(kind)
        interval = self._interval.get(kind, self._explore_every)
        if len(self.candidates) > 1 and steps % interval == 0:
            others = [c for c in self.candidates if c != choice]
            untried = [c for c in others if c not in costs]
            self._turn += 1
            choice = untried[0] if untried else others[self._turn % len(others)]
        self.current = choice
        return choice

    def record(self, kind: str, threads: int, seconds: float, tokens: int) -> None:
        unit = seconds if kind == "decode" else seconds / max(1, tokens)
        costs = self._costs(kind)
        best = self.best(kind) if costs else threads
        old = costs.get(threads)
        samples = self._samples.setdefault((kind, threads), deque(maxlen=WINDOW))
        if old is not None and unit < 0.5 * old:
            # The machine changed (a neighbour left): this sample stands for the count
            # at once, rather than after many rare trials.
            samples.clear()
        samples.append(unit)
        costs[threads] = statistics.median(samples)
        if threads != best and best in costs:
            slow = costs[threads] > 1.5 * costs[best]
            interval = self._interval.get(kind, self._explore_every)
            interval = interval * 2 if slow else self._explore_every
            self._interval[kind] = min(interval, 16 * self._explore_every)


def embed_kind(tokens: int) -> str:
    """The tuner's kind for an embedding ubatch of ``tokens`` tokens.

    One kind per size class (under 16 tokens, under 128, under 1,024, more), since the
    best count depends on the size: measured on 2 cores with the default model
    (``benchmarks/embeddings.py``), a single short input embeds fastest with 1 thread
    and 32 or 512 inputs with 2; a chat prompt chunk's choice fits neither.
    """
    return f"embed/{sum(tokens >= bound for bound in (16, 128, 1024))}"
