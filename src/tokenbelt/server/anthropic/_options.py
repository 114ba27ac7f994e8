"""``thinking``, ``context_management`` and ``output_config``: taken where they can be kept.

Claude Code sends all three on every request. ``thinking`` maps onto a thinking model's
reasoning phase (``enabled`` with ``budget_tokens``: tokenbelt's reasoning budget;
``disabled``: no reasoning); asking a model without one to think is refused by the engine.
A value that would make the reply or the prompt other than this server makes it is
refused by name (``UnsupportedParameter``, a 400), never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..._errors import InvalidArgument
from ...engines import Grammar, schema_grammar
from ..core import UnsupportedParameter, ranges


class Thinking(BaseModel):
    """``thinking``: a thinking model's reasoning phase, on, off or the model's way."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["enabled", "adaptive", "disabled"] = Field(
        description=(
            "enabled: a thinking model reasons first (thinking blocks), at most "
            "budget_tokens tokens; a model without a thinking phase refuses it. "
            "disabled: it answers at once. adaptive: the model's own way"
        )
    )
    budget_tokens: int | None = ranges.bounded(
        "reasoning_budget", description="only with enabled: the reasoning budget"
    )
    display: Literal["summarized", "omitted"] | None = Field(
        None,
        description="summarized is what a local model's thinking is (its own text); "
        "omitted is refused (the blocks would come empty)",
    )

    def check(self) -> None:
        if self.budget_tokens is not None and self.type != "enabled":
            raise UnsupportedParameter("thinking.budget_tokens", "it goes with type 'enabled'")
        if self.display == "omitted" and self.type == "enabled":
            raise UnsupportedParameter(
                "thinking.display", "'omitted': this server sends the thinking it makes"
            )

    def sampling(self) -> dict[str, object]:
        """``think`` and ``reasoning_budget`` for the runtime."""
        think = {"enabled": True, "disabled": False}.get(self.type)
        return {"think": think, "reasoning_budget": self.budget_tokens}


class ContextEdit(BaseModel):
    """One of ``context_management.edits``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: str = Field(max_length=100)
    keep: str | dict[str, Any] | None = Field(
        None, description="which thinking turns to keep: there are none, so any value"
    )


class ContextManagement(BaseModel):
    """``context_management``: only edits that clear thinking, which have nothing to clear."""

    model_config = ConfigDict(extra="forbid", strict=True)

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


class OutputFormat(BaseModel):
    """``output_config.format``: the answer is JSON that validates against ``schema``
    (Anthropic's structured outputs), kept by a grammar as ``response_format`` is on
    ``/v1``."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema", description="a JSON schema")

    def grammar(self) -> Grammar:
        """The schema's grammar; ``UnsupportedParameter`` when it cannot be compiled."""
        try:
            return schema_grammar(self.json_schema)
        except InvalidArgument as exc:
            raise UnsupportedParameter("output_config.format.schema", str(exc)) from exc


class OutputConfig(BaseModel):
    """``output_config``: ``effort`` ``high`` (Anthropic's default) only, and ``format``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None,
        description=(
            "high is accepted: it is Anthropic's default, the same as sending no effort, "
            "and what this server always does. Any other level asks the model to spend "
            "fewer or more tokens, which a model without reasoning is not told how to do "
            "here: refused"
        ),
    )

    format: OutputFormat | None = Field(
        None, description="json_schema: the answer validates against the schema"
    )

    def check(self) -> None:
        if self.effort not in (None, "high"):
            raise UnsupportedParameter(
                "output_config.effort",
                f"{self.effort!r}: a model without reasoning answers at one effort, "
                "Anthropic's default 'high'",
            )
