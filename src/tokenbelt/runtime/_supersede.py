"""Supersede keys: a newer request with the same key ends the older ones, queued or running.

A code completion is stale as soon as the next keystroke asks for another: the editor
sends a key with each (llama.cpp's ``id_slot``, tokenbelt's ``supersede``), and a
``Claim`` on that key ends every request the previous claim holds with ``superseded``,
through the same cancel a Stop button uses (``Belt.cancel``: out of the queue, or out
of the running step within one decode step, prefill included). A claim may hold
several requests (the candidates of one completion); a request added to a claim that
was already superseded ends at once.
"""

from __future__ import annotations

import threading
from typing import Any

from ..belt import Belt, EndReason

#: keys remembered at most; the oldest whose requests all ended are forgotten first
MAX_KEYS = 4096


class Claim:
    """The requests of one completion under its key (``Superseding.claim``)."""

    def __init__(self, owner: Superseding, key: str) -> None:
        self.key = key
        self._owner = owner
        self._belts: list[Belt[Any]] = []
        #: set once a newer claim on the key took this one's place
        self.superseded = False

    def add(self, belt: Belt[Any]) -> None:
        """Hold ``belt`` under this claim; a claim already superseded ends it at once."""
        with self._owner.lock:
            if not self.superseded:
                self._belts.append(belt)
                return
        belt.cancel(EndReason.SUPERSEDED)

    def _take(self) -> list[Belt[Any]]:
        self.superseded = True
        belts, self._belts = self._belts, []
        return belts

    def live(self) -> bool:
        return not self.superseded and any(b.end_reason is None for b in self._belts)


class Superseding:
    """The latest claim of each key, for one model (thread-safe; never blocks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._latest: dict[str, Claim] = {}
        #: requests this registry ended (``superseded``), since it was made
        self.superseded = 0

    def claim(self, key: str) -> Claim:
        """A new claim on ``key``: every request of the previous one that is still queued
        or running ends ``superseded`` before this returns (their release follows within
        about one decode step)."""
        claim = Claim(self, key)
        with self.lock:
            old = self._latest.pop(key, None)
            self._latest[key] = claim
            stale = old._take() if old is not None else []
            if len(self._latest) > MAX_KEYS:
                self._forget()
        ended = sum(1 for belt in stale if belt.cancel(EndReason.SUPERSEDED))
        with self.lock:
            self.superseded += ended
        return claim

    def _forget(self) -> None:
        """Drop the oldest keys whose requests all ended (under ``lock``)."""
        for key in list(self._latest):
            if len(self._latest) <= MAX_KEYS // 2:
                return
            if not self._latest[key].live():
                del self._latest[key]
