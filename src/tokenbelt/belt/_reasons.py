"""Why a request ended: exactly one reason per request."""

from __future__ import annotations

import enum


class EndReason(enum.StrEnum):
    """The single reason a request ended.

    The first reason recorded wins; later ones are ignored.
    """

    #: the model produced an end-of-generation token or a stop string
    STOP = "stop"
    #: ``max_tokens`` or the context window was reached
    LENGTH = "length"
    #: a user asked to stop (SDK cancel, ``break``, cancel endpoint, Stop button, Ctrl-C)
    USER_CANCEL = "user_cancel"
    #: the HTTP client went away
    CLIENT_DISCONNECT = "client_disconnect"
    #: a newer request with the same supersede key took its place (the next keystroke's
    #: completion), queued or running
    SUPERSEDED = "superseded"
    #: the HTTP client's socket accepted nothing for the reader timeout (an abandoned stream)
    READER_TIMEOUT = "reader_timeout"
    #: no first token before the first-token deadline (counted from enqueue)
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    #: the whole request ran past its total deadline
    TOTAL_TIMEOUT = "total_timeout"
    #: the gap between two tokens was longer than the stall limit
    STALL_TIMEOUT = "stall_timeout"
    #: the model did not load before its load deadline
    LOAD_TIMEOUT = "load_timeout"
    #: the admission queue was full
    REJECTED = "rejected"
    #: the engine or the producer raised
    RUNTIME_ERROR = "runtime_error"
    #: the runtime was closed while the request was queued or running
    SHUTDOWN = "shutdown"

    @property
    def is_natural(self) -> bool:
        """True for ends the model chose (``stop``, ``length``)."""
        return self in (EndReason.STOP, EndReason.LENGTH)

    @property
    def is_cancel(self) -> bool:
        """True for ends the producer did not choose: a stop, a deadline, shutdown
        (neither a natural end nor the engine's own ``runtime_error``)."""
        return not self.is_natural and self is not EndReason.RUNTIME_ERROR

    @property
    def is_timeout(self) -> bool:
        """True for the deadline reasons."""
        return self in _TIMEOUTS

    @property
    def openai_finish_reason(self) -> str:
        """The ``finish_reason`` for OpenAI-style answers: always one of OpenAI's own values.

        ``stop`` and ``length`` are themselves; the ends a caller chose (``user_cancel``,
        ``client_disconnect``, ``reader_timeout``: it stopped reading; ``superseded``: it
        sent the request that replaced this one) are ``stop``; every
        other end cut the reply short for a reason the caller did not choose (a deadline,
        ``shutdown``, ``rejected``, ``runtime_error``) and is ``length``, the value clients
        read as "truncated".
        The exact reason travels beside it (``tokenbelt.end_reason``).
        """
        if self.is_natural:
            return self.value
        if self in _CHOSEN:
            return "stop"
        return "length"


_CHOSEN = frozenset(
    {
        EndReason.USER_CANCEL,
        EndReason.CLIENT_DISCONNECT,
        EndReason.READER_TIMEOUT,
        EndReason.SUPERSEDED,
    }
)
_TIMEOUTS = frozenset(
    {
        EndReason.FIRST_TOKEN_TIMEOUT,
        EndReason.TOTAL_TIMEOUT,
        EndReason.STALL_TIMEOUT,
        EndReason.LOAD_TIMEOUT,
    }
)
