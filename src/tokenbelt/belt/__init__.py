"""Layer 1: the belt, cancellation, deadlines, trace and end reasons. No model here."""

from ._belt import Belt, BeltReader, BeltStatistics
from ._limits import Deadlines, Limits, check_capacity, check_duration
from ._reasons import EndReason
from ._trace import DEFAULT_RELEASE_LAG_THRESHOLD, Observer, Trace, TraceEvent, new_request_id

__all__ = [
    "DEFAULT_RELEASE_LAG_THRESHOLD",
    "Belt",
    "BeltReader",
    "BeltStatistics",
    "Deadlines",
    "EndReason",
    "Limits",
    "Observer",
    "Trace",
    "TraceEvent",
    "check_capacity",
    "check_duration",
    "new_request_id",
]
