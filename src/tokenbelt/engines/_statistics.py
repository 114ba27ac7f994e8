"""The snapshots engines report: what the server's metrics and health pages read.

Every engine's ``statistics()`` returns an ``EngineStatistics`` (frozen, as trio's
``MemoryChannelStatistics``): its slots and running requests, and the parts it has.
A batch engine's is a ``BatchStatistics`` with the loop's counters; a worker engine's
also carries its process (``worker``); a remote engine's, its upstreams' counters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStatistics:
    """What every engine reports (a snapshot)."""

    #: requests the engine can run at once
    slots: int
    #: requests started and not yet released
    running: int
    #: the worker process, for an engine that runs in one
    worker: WorkerStatistics | None = field(default=None, kw_only=True)
    #: every upstream's counters, for an engine that fronts other servers
    upstreams: tuple[UpstreamStatistics, ...] | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class BatchStatistics(EngineStatistics):
    """Counters of a batch engine since load (a snapshot): ``slots`` and ``running``, then
    the loop's own counters."""

    steps: int
    #: sum over steps of the sequences in each step
    sequences_stepped: int
    #: sum over steps of the tokens in each step
    tokens_stepped: int
    aborted_steps: int
    prefix_hits: int
    prefix_cached_tokens: int
    cache_entries: int
    #: llama.cpp threads of the latest step
    threads: int
    #: steps the stop watch aborted: still running ``stop_abort_after`` after a stop
    stop_aborted_steps: int = 0
    #: prefix-cache entries (and their tokens) read back from disk at load
    restored_entries: int = 0
    restored_tokens: int = 0
    #: prefix-cache entries (and their bytes on disk) written at close
    saved_entries: int = 0
    saved_bytes: int = 0
    #: prompt-lookup draft tokens verified in steps, and those the samplers accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    #: requests by why drafting was on or off for them (``on``, ``no_gain``,
    #: ``nothing_to_copy``, ``constrained``, ``asked_off``)
    draft_decisions: dict[str, int] = field(default_factory=dict)
    #: seconds a step of n tokens took here, as the engine plans by them (a moving
    #: average per size, up to 64 tokens): one row against several is what drafting
    #: weighs (``row_costs``)
    step_costs: dict[int, float] = field(default_factory=dict)

    def row_costs(self, most: int = 17) -> dict[int, float]:
        """What a step of n tokens costs over a step of one, for each n timed up to
        ``most`` (empty until a one-token step ran)."""
        one = self.step_costs.get(1)
        if not one:
            return {}
        return {n: s / one for n, s in sorted(self.step_costs.items()) if 1 < n <= most}

    @property
    def sequences_per_step(self) -> float:
        return self.sequences_stepped / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens_stepped / self.steps if self.steps else 0.0


class WorkerState(enum.Enum):
    """Where an engine's worker process is in its life."""

    #: a worker process is starting and loading the model
    STARTING = "starting"
    #: a worker is serving requests
    READY = "ready"
    #: the worker died; a new one starts after the backoff
    RESTARTING = "restarting"
    #: workers kept dying before they were ready: requests end at once with the reason
    FAILED = "failed"
    #: closed: the worker ended and its memory went back to the system
    CLOSED = "closed"


@dataclass(frozen=True)
class WorkerStatistics:
    """A snapshot of an engine's worker process."""

    state: str
    #: the running worker's process id (None while none runs)
    pid: int | None
    #: workers started after the first
    restarts: int
    #: why the latest worker that died died, e.g. "engine worker killed by signal 9 (SIGKILL)"
    last_crash: str | None
    #: resident memory of the running worker in bytes (None while none runs)
    rss_bytes: int | None
    #: why the engine failed (workers kept dying while loading), or None
    failure: str | None = None
    #: times one of the parent's threads for it (sender, supervisor) failed and was
    #: started again (each is logged)
    thread_failures: int = 0
    #: seconds the running worker has answered no heartbeat, once past the bound (a
    #: frozen or stuck worker: not ready); None while it answers
    unresponsive_s: float | None = None


@dataclass(frozen=True)
class UpstreamStatistics:
    """A snapshot of one upstream's counters."""

    url: str
    model: str
    in_flight: int
    max_concurrency: int
    requests: int
    errors: int
    ejections: int
    ejected: bool
    #: why it was last taken out (None while it has never been)
    last_error: str | None
    #: time to first token, as the front measured it: sum of seconds and count
    ttft_sum: float
    ttft_count: int
    #: True once the upstream was seen to be a tokenbelt server
    tokenbelt: bool
