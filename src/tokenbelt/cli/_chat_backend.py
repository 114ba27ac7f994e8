"""What ``tokenbelt chat`` asks of a backend, in-process or over HTTP.

A ``Backend`` starts a ``Turn`` per user line and keeps the conversation; a ``Turn``
streams the reply's text, can be cancelled (``user_cancel``), and summarises its trace
once the engine let go of it (``TurnSummary``, the line printed after each reply).
``_chat_local.py`` and ``_chat_remote.py`` are the two backends; ``_chat.py`` the loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import TokenbeltError

#: how long a turn may take to be released after it ended, before we stop waiting
RELEASE_WAIT_S = 5.0
NATURAL_ENDS = frozenset({"stop", "length"})


class TurnError(TokenbeltError):
    """The server refused a turn (an HTTP error); the chat goes on."""


@dataclass(frozen=True)
class TurnSummary:
    """The figures printed after each reply, from the request's trace."""

    end_reason: str | None
    time_to_first_token_ms: float | None
    decode_tok_s: float | None
    cancel_to_release_ms: float | None
    released: bool
    completion_tokens: int | None = None
    prompt_tokens: int | None = None

    @classmethod
    def from_trace(cls, trace: dict[str, Any] | None) -> TurnSummary:
        if trace is None:
            return cls(None, None, None, None, False)
        return cls(
            end_reason=trace.get("end_reason"),
            time_to_first_token_ms=trace.get("time_to_first_token_ms"),
            decode_tok_s=trace.get("decode_tok_s"),
            cancel_to_release_ms=trace.get("cancel_to_release_ms"),
            released=(trace.get("timeline_ms") or {}).get("released") is not None,
            completion_tokens=trace.get("completion_tokens"),
            prompt_tokens=trace.get("prompt_tokens"),
        )

    def length_hint(self, max_tokens: int) -> str | None:
        """Why a reply that ended ``length`` stopped, and what to do about it."""
        if self.end_reason != "length":
            return None
        if self.completion_tokens is not None and self.completion_tokens < max_tokens:
            return (
                "the reply stopped because the context is full; /clear or /undo make room "
                "(or serve with a larger --n-ctx)"
            )
        return (
            f"the reply stopped at the {max_tokens}-token limit; "
            "start the chat with --max-tokens N for longer replies"
        )

    def line(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        rate = "-" if self.decode_tok_s is None else f"{self.decode_tok_s:.1f}"
        released = "" if self.released else " (not released yet)"
        # Only a stopped reply has a cancel to release: a natural end has nothing to say.
        stop = self.cancel_to_release_ms
        cancel = "" if stop is None else f", cancel to release {ms(stop)}"
        return (
            f"first token {ms(self.time_to_first_token_ms)}, {rate} tok/s, "
            f"end {self.end_reason or 'unknown'}{cancel}{released}"
        )


class Turn(Protocol):
    """One reply in flight."""

    def __iter__(self) -> Iterator[str]: ...

    def cancel(self) -> None:
        """Stop generation (``user_cancel``); returns without waiting for the release."""

    def summary(self) -> TurnSummary:
        """Wait (bounded) for the release, then summarise the turn's trace."""


class Backend(Protocol):
    def start(self, text: str) -> Turn: ...

    def clear(self) -> None:
        """Forget the conversation; the system prompt stays."""

    def undo(self) -> bool:
        """Take back the last exchange; False when there is none."""

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None removes it)."""

    def switch(self, name: str) -> str:
        """Use model ``name`` from now on; returns a line describing it. Raises on failure."""

    def close(self) -> None: ...


def set_system_prompt(messages: list[Any], text: str | None) -> None:
    """Replace the system message at the head of ``messages`` (None or "" removes it)."""
    messages[:] = [m for m in messages if m["role"] != "system"]
    if text:
        messages.insert(0, {"role": "system", "content": text})


def undo_exchange(messages: list[Any]) -> bool:
    """Drop the last user message and what followed it; False when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            del messages[i:]
            return True
    return False
