"""``thinking``, ``context_management`` and ``output_config``: taken where they ask nothing.

Claude Code sends all three on every request. No model tokenbelt serves has a thinking
phase, so a value that amounts to "no thinking" is what happens anyway and is accepted;
a value that would need one, or would make the reply or the prompt other than this
server makes it, is refused by name (``UnsupportedParameter``, a 400), never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core import UnsupportedParameter

_NO_THINKING = "no model tokenbelt serves has a thinking phase"


class Thinking(BaseModel):
    """``thinking``: ``disabled`` and ``adaptive`` are accepted, ``enabled`` is refused."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "adaptive", "disabled"] = Field(
        description=(
            "disabled: no thinking, as always here. adaptive lets the model decide "
            "whether to think; a model with no thinking phase never does, so it is "
            "accepted and is the same as disabled. enabled (with budget_tokens) asks for "
            "a thinking phase and is refused"
        )
    )
    budget_tokens: int | None = Field(None, ge=0, description="only with enabled")
    display: Literal["summarized", "omitted"] | None = Field(
        None, description="accepted: there are no thinking blocks to summarize or omit"
    )

    def check(self) -> None:
        if self.type == "enabled":
            raise UnsupportedParameter(
                "thinking.type",
                f"'enabled' asks for a thinking phase and {_NO_THINKING}; "
                "send 'disabled' or 'adaptive', or no thinking at all",
            )
        if self.budget_tokens is not None:
            raise UnsupportedParameter("thinking.budget_tokens", "it goes with type 'enabled'")


class ContextEdit(BaseModel):
    """One of ``context_management.edits``."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(max_length=100)
    keep: str | dict[str, Any] | None = Field(
        None, description="which thinking turns to keep: there are none, so any value"
    )


class ContextManagement(BaseModel):
    """``context_management``: only edits that clear thinking, which have nothing to clear."""

    model_config = ConfigDict(extra="forbid")

    edits: list[ContextEdit] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "clear_thinking_* edits are accepted and change nothing: no thinking block is "
            "ever produced, so none is ever sent back to clear. Any other edit (clearing "
            "tool uses...) would change the prompt, which this server does not do: refused"
        ),
    )

    def check(self) -> None:
        for i, edit in enumerate(self.edits):
            if not edit.type.startswith("clear_thinking_"):
                raise UnsupportedParameter(
                    f"context_management.edits[{i}].type",
                    f"{edit.type!r}: this server edits no prompt; it takes only "
                    "clear_thinking_* edits, which have nothing to clear here",
                )


class OutputConfig(BaseModel):
    """``output_config``: ``effort`` ``high`` (Anthropic's default) only; no ``format``."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None,
        description=(
            "high is accepted: it is Anthropic's default, the same as sending no effort, "
            "and what this server always does. Any other level asks the model to spend "
            "fewer or more tokens, which a model without reasoning is not told how to do "
            "here: refused"
        ),
    )

    def check(self) -> None:
        if self.effort not in (None, "high"):
            raise UnsupportedParameter(
                "output_config.effort",
                f"{self.effort!r}: a model without reasoning answers at one effort, "
                "Anthropic's default 'high'",
            )
