"""Layer 1: the belt, cancellation, deadlines, trace and end reasons. No model here."""

from . import _invariants as invariants
from ._belt import Belt, BeltStatistics
from ._limits import (
    MAX_DURATION_S,
    MAX_KEEP_ALIVE_S,
    Deadlines,
    Limits,
    check_capacity,
    check_duration,
    check_keep_alive,
)
from ._ranges import MAX_CONTEXT, RANGES, Range, check
from ._reasons import EndReason
from ._timer import DeadlineTimer
from ._trace import DEFAULT_RELEASE_LAG_THRESHOLD, Observer, Trace, TraceEvent, new_request_id
from ._views import BeltReader, Producer, producing

__all__ = [
    "DEFAULT_RELEASE_LAG_THRESHOLD",
    "MAX_CONTEXT",
    "MAX_DURATION_S",
    "MAX_KEEP_ALIVE_S",
    "RANGES",
    "Belt",
    "BeltReader",
    "BeltStatistics",
    "DeadlineTimer",
    "Deadlines",
    "EndReason",
    "Limits",
    "Observer",
    "Producer",
    "Range",
    "Trace",
    "TraceEvent",
    "check",
    "check_capacity",
    "check_duration",
    "check_keep_alive",
    "invariants",
    "new_request_id",
    "producing",
]
