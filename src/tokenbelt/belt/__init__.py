"""Layer 1: the belt, cancellation, deadlines, trace and end reasons. No model here."""

from . import _invariants as invariants
from ._belt import Belt, BeltStatistics
from ._limits import Deadlines, Limits, check_capacity, check_duration
from ._reasons import EndReason
from ._timer import DeadlineTimer
from ._trace import DEFAULT_RELEASE_LAG_THRESHOLD, Observer, Trace, TraceEvent, new_request_id
from ._views import BeltReader, Producer, producing

__all__ = [
    "DEFAULT_RELEASE_LAG_THRESHOLD",
    "Belt",
    "BeltReader",
    "BeltStatistics",
    "DeadlineTimer",
    "Deadlines",
    "EndReason",
    "Limits",
    "Observer",
    "Producer",
    "Trace",
    "TraceEvent",
    "check_capacity",
    "check_duration",
    "invariants",
    "new_request_id",
    "producing",
]
