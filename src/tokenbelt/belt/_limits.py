"""Per-request time limits (relative seconds) and the absolute deadlines made from them."""

from __future__ import annotations

from dataclasses import dataclass

from ._ranges import RANGES, check

#: the longest duration any surface accepts (a deadline, a grace, a timeout, a delay): a
#: year, in seconds. Past it no timer can wait (``threading`` raises ``OverflowError``,
#: which killed the thread that waited) and no date can be written.
MAX_DURATION_S = RANGES["timeout"].high
#: the longest ``keep_alive`` (SDK, ``--keep-alive``, Ollama's field): the same year
MAX_KEEP_ALIVE_S = RANGES["keep_alive"].high


def check_keep_alive(value: float | None) -> float | None:
    """``value`` as seconds a model stays loaded when idle (``None``: for ever); raises
    ``InvalidArgument`` (naming ``keep_alive`` and its range) unless 0 <= value <= a year."""
    return None if value is None else float(check("keep_alive", value))


def check_duration(name: str, value: float | None, *, allow_zero: bool = True) -> float | None:
    """Return ``value`` as a float if it is a valid duration in seconds, else raise.

    ``None`` means "no limit". The range is the table's: ``delay`` (0 to a year) or, with
    ``allow_zero=False``, ``timeout`` (more than 0, at most a year); NaN and infinity are
    refused.
    """
    if value is None:
        return None
    return float(check("delay" if allow_zero else "timeout", value, label=name))


def check_capacity(value: int, *, name: str = "capacity") -> int:
    """Reject a count outside its range in ``RANGES`` (trio: no unbounded buffers); a
    ``name`` the table does not hold has the range of ``capacity``."""
    return int(check(name if name in RANGES else "capacity", value, label=name))


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
