"""The OpenAI dialect's ``finish_reason``: tokenbelt's end reasons in OpenAI's vocabulary."""

from __future__ import annotations

from ...belt import EndReason

#: the ends a caller chose (it stopped reading, or asked to stop): OpenAI's ``stop``
_CALLER_STOPS = frozenset(
    {EndReason.USER_CANCEL, EndReason.CLIENT_DISCONNECT, EndReason.READER_TIMEOUT}
)


def finish_reason(reason: EndReason) -> str:
    """The ``finish_reason`` of an OpenAI-style answer: always one of OpenAI's own values.

    ``stop`` and ``length`` are themselves; the ends a caller chose (``user_cancel``,
    ``client_disconnect``, ``reader_timeout``: it stopped reading) are ``stop``; every
    other end cut the reply short for a reason the caller did not choose (a deadline,
    ``shutdown``, ``rejected``, ``runtime_error``) and is ``length``, the value clients
    read as "truncated". The exact reason travels beside it (``tokenbelt.end_reason``).
    """
    if reason.is_natural:
        return reason.value
    return "stop" if reason in _CALLER_STOPS else "length"
