"""Executable invariants of a request's timeline, checked on every trace event.

Off by default (one attribute read per event). Turn it on with ``enable()``, the
``TOKENBELT_CHECK_INVARIANTS=1`` environment variable, or ``tokenbelt serve
--check-invariants``; the test suite runs with it on and fails any test that
broke one. What holds for every request:

- each event is delivered once (``release_lag`` included), and nothing but
  ``release_lag`` follows ``released``;
- ``ended`` comes before ``released``, and the end reason is recorded by then;
- a stop (any end that is not ``stop``, ``length`` or ``runtime_error``) has
  ``cancel_requested`` recorded before its ``ended``;
- timestamps never go backwards: enqueued <= admitted <= first_token <=
  last_token <= released, and cancel_requested <= released.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._trace import TraceEvent

logger = logging.getLogger("tokenbelt.invariants")

#: Checked by ``Trace.flush`` before it delivers each event.
enabled: bool = os.environ.get("TOKENBELT_CHECK_INVARIANTS", "") not in ("", "0")

_lock = threading.Lock()
_violations: list[str] = []
_MAX_KEPT = 100
_count = 0

_ORDER = ("enqueued", "admitted", "first_token", "last_token", "released")
_STOPS = frozenset(
    {
        "user_cancel",
        "client_disconnect",
        "reader_timeout",
        "first_token_timeout",
        "total_timeout",
        "stall_timeout",
        "load_timeout",
        "rejected",
        "shutdown",
    }
)


def enable(on: bool = True) -> None:
    """Check every trace event from now on (or stop checking)."""
    global enabled
    enabled = on


def violations() -> list[str]:
    """The violations seen since the last ``clear()`` (at most the first 100)."""
    with _lock:
        return list(_violations)


def count() -> int:
    """Violations seen since the process started (``clear()`` does not reset it)."""
    return _count


def clear() -> list[str]:
    """Forget the violations seen so far and return them."""
    with _lock:
        seen = list(_violations)
        _violations.clear()
    return seen


def _violate(event: TraceEvent, what: str) -> None:
    message = f"request {event.trace.request_id}: {what} (at event {event.kind!r})"
    logger.error("invariant violated: %s", message)
    global _count
    with _lock:
        _count += 1
        if len(_violations) < _MAX_KEPT:
            _violations.append(message)


def check(event: TraceEvent, emitted: list[str]) -> None:
    """Check one event; ``emitted`` is every kind delivered so far, this one last."""
    t = event.trace
    kind = event.kind
    if emitted.count(kind) > 1:
        _violate(event, f"{kind} delivered twice")
    before = emitted[:-1]
    if "released" in before and kind != "release_lag":
        _violate(event, f"{kind} after released")
    if kind == "ended" and t.end_reason is None:
        _violate(event, "ended without an end reason")
    reason = t.end_reason.value if t.end_reason is not None else None
    if kind == "ended" and reason in _STOPS and "cancel_requested" not in before:
        _violate(event, f"{reason} ended before its cancel_requested")
    if kind != "released":
        return
    if t.end_reason is None or "ended" not in before:
        _violate(event, "released before its end reason")
    times = [(name, getattr(t, name)) for name in _ORDER]
    present = [(name, value) for name, value in times if value is not None]
    for (a, x), (b, y) in itertools.pairwise(present):
        if y < x:
            _violate(event, f"{b} ({y:.6f}) before {a} ({x:.6f})")
    cancel, released = t.cancel_requested, t.released
    if cancel is not None and released is not None and released < cancel:
        _violate(event, "released before cancel_requested")
