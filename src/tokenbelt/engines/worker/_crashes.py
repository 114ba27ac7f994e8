"""The crash history of a worker engine's processes: how long to wait before the next
worker starts, and when workers that keep dying while loading fail the engine."""

from __future__ import annotations

import time

#: restart delays after consecutive crashes (the last one repeats)
BACKOFF = (0.0, 0.25, 0.5, 1.0, 2.0, 5.0)
#: a crash this long after the previous one starts the backoff again
CALM_S = 30.0


class Crashes:
    """Counts crashes in a row (each within ``CALM_S`` of the one before) for the
    backoff, and workers in a row that died before they were ready, for the failure."""

    def __init__(self, max_load_crashes: int) -> None:
        self.max_load_crashes = max(1, max_load_crashes)
        #: the cause of the latest crash (None: none yet)
        self.last: str | None = None
        self._in_row = 0
        self._last_at = 0.0
        #: workers in a row that died before they were ready
        self.while_loading = 0

    def record(self, cause: str, *, was_ready: bool) -> None:
        now = time.monotonic()
        self.last = cause
        self._in_row = self._in_row + 1 if now - self._last_at < CALM_S else 1
        self._last_at = now
        if not was_ready:
            self.while_loading += 1

    def loaded(self) -> None:
        """A worker became ready: the engine loads after all."""
        self.while_loading = 0

    @property
    def load_failed(self) -> bool:
        """Whether workers died while loading ``max_load_crashes`` times in a row."""
        return self.while_loading >= self.max_load_crashes

    def backoff(self) -> float:
        """Seconds before the next worker starts: none after a first crash, then more."""
        return BACKOFF[min(self._in_row, len(BACKOFF)) - 1]
