"""Per-request time limits (relative seconds) and the absolute deadlines made from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._errors import InvalidArgument


def check_duration(name: str, value: float | None, *, allow_zero: bool = True) -> float | None:
    """Return ``value`` as a float if it is a valid duration in seconds, else raise.

    ``None`` means "no limit". Negative, NaN and infinite values are rejected.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a number, got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise InvalidArgument(f"{name} must be positive, got {value!r}")
    return seconds


def check_capacity(value: int, *, name: str = "capacity") -> int:
    """Reject a capacity that is not an integer >= 1 (trio: no unbounded buffers)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Limits:
    """Time limits for one request, in seconds; ``None`` means no limit.

    Like httpx's ``Timeout``, one small object holds every phase:

    - ``first_token``: from enqueue to the first token (queue wait counts);
    - ``total``: from enqueue to the last token;
    - ``stall``: the longest allowed gap between two tokens, counted from the first
      token (the prefill is ``first_token``'s to bound)
      (time the producer spends waiting on a full belt does not count);
    - ``load``: how long loading the model may take.
    """

    first_token: float | None = None
    total: float | None = None
    stall: float | None = None
    load: float | None = None

    def __post_init__(self) -> None:
        for name in ("first_token", "total", "stall", "load"):
            check_duration(f"Limits.{name}", getattr(self, name), allow_zero=False)

    def deadlines(self, now: float) -> Deadlines:
        """The absolute deadlines for a request enqueued at monotonic time ``now``."""
        return Deadlines(
            first_token=None if self.first_token is None else now + self.first_token,
            total=None if self.total is None else now + self.total,
            stall=self.stall,
        )


@dataclass(frozen=True)
class Deadlines:
    """Absolute monotonic deadlines for one belt; ``stall`` stays a duration.

    The stall deadline moves: it is ``stall`` seconds after the latest token, and
    not armed before the first one (``first_token`` bounds the prefill). It is not
    armed while the belt is full, and restarts when a read makes room: a slow reader pauses the
    producer, it does not stall it.
    """

    first_token: float | None = None
    total: float | None = None
    stall: float | None = None
