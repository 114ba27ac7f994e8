"""How long an idle model stays loaded: its default keep-alive, the next idle's (a
request's own, Ollama's ``keep_alive``), and the one timer that unloads it.

``Model`` owns one ``KeepAlive`` and gives it the model's lock and a way to unload;
the rules of who may change what live here: a pinned model stays loaded (no timer, and
a request's ``0`` is refused), a model whose engines were given ready-made cannot be
unloaded at all (it could not be loaded again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

from .._errors import IllegalState, InvalidArgument
from ..belt import check_keep_alive

logger = logging.getLogger("tokenbelt.runtime")

#: a request's keep-alive: seconds, None (for ever) or the model's own
RequestKeepAlive = float | Literal["default"] | None


class KeepAlive:
    """The keep-alive of one model and its timer.

    ``expire(timer)`` is called on the timer's thread: it unloads the model if it is
    idle and ``timer`` is still the current one (``timer``), and may raise (the
    failure is logged and the timer armed again, so the model is never left without
    one, silently). ``ready()`` says whether the model is loaded, read under ``lock``.
    """

    def __init__(
        self,
        name: str,
        seconds: float | None,
        *,
        pinned: bool,
        reloadable: bool,
        lock: threading.RLock,
        ready: Callable[[], bool],
        expire: Callable[[threading.Timer], object],
    ) -> None:
        self.name = name
        self.pinned = pinned
        self.reloadable = reloadable
        #: the default of every request that gives none (None: for ever; pinned: None)
        self.default = None if pinned else check_keep_alive(seconds)
        #: the keep-alive of the next idle unload: the latest request's own, else the
        #: default; each request sets it, so one request's value never outlives the next's
        self.next_idle: float | None = self.default
        self._lock = lock
        self._ready = ready
        self._expire = expire
        self._timer: threading.Timer | None = None

    @property
    def timer(self) -> threading.Timer | None:
        """The running timer of the next idle unload (None: none runs)."""
        return self._timer

    def arm(self) -> None:
        """Start the timer of the next idle unload (again, if one runs); nothing for a
        keep-alive of for ever, or a model that is not loaded (closed meanwhile: a timer
        armed now would outlive it)."""
        seconds = self.next_idle
        if seconds is None:
            return
        with self._lock:
            if not self._ready():
                return
            self.cancel()
            timer = threading.Timer(seconds, lambda: self.expired(timer))
            timer.daemon = True
            timer.name = f"tokenbelt-keepalive-{self.name}"
            self._timer = timer
            timer.start()

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def for_request(self, keep_alive: RequestKeepAlive) -> None:
        """Take a request's own keep-alive (``"default"``: the model's) for the next idle
        unload, after checking it: ``InvalidArgument`` out of range or ``0`` on a pinned
        model (which stays loaded: no request's value is longer), ``IllegalState`` if
        the model cannot be unloaded."""
        if keep_alive != "default":
            keep_alive = check_keep_alive(keep_alive)
            if self.pinned:
                self._check_pinned(keep_alive)
                keep_alive = "default"
            if keep_alive is not None:
                self._check_reloadable()
        with self._lock:
            self.next_idle = self.default if keep_alive == "default" else keep_alive

    def change(self, seconds: float | None, *, default: bool) -> float | Literal[False] | None:
        """Set the keep-alive (``default``: for every later request too, else once) and
        stop the running timer; returns the seconds now in force, or False when nothing
        changed (a pinned model's once-only value). Raises as ``for_request``."""
        seconds = check_keep_alive(seconds)
        if self.pinned and not default:
            self._check_pinned(seconds)
            return False  # a pinned model stays loaded longer than any request's keep-alive
        if seconds is not None:
            self._check_reloadable()
        with self._lock:
            if default:
                self.default = seconds
            self.next_idle = seconds
            self.cancel()
        return seconds

    def _check_pinned(self, seconds: float | None) -> None:
        if seconds == 0:
            raise InvalidArgument(
                f"model {self.name} is pinned (--pin): keep_alive 0 cannot unload it",
                param="keep_alive",
            )

    def _check_reloadable(self) -> None:
        if not self.reloadable:
            raise IllegalState(
                f"model {self.name} cannot be unloaded: its engines were given ready-made "
                "and could not be made again"
            )

    def expired(self, timer: threading.Timer) -> None:
        """The timer's thread: ``expire(timer)``; a failure is logged, the timer armed again."""
        try:
            self._expire(timer)
        except Exception:
            logger.exception("the keep-alive timer of %s failed; armed again", self.name)
            self.arm()
