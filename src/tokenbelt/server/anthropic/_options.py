"""``thinking``, ``context_management`` and ``output_config``: what Claude Code sends.

Claude Code sends all three on every request. ``thinking`` maps onto a thinking model's
reasoning phase (``enabled`` with ``budget_tokens``: tokenbelt's reasoning budget;
``disabled``: no reasoning); asking a model without one to think is refused by the engine.
``output_config.effort`` is a thinking model's reasoning budget; a model without a
thinking phase takes every effort and says its answer is the same at each. The context
edits are applied to the prompt (``_context``). A value this server cannot honour is
refused by name (``UnsupportedParameter``, a 400), never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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


class Count(BaseModel):
    """A threshold or an amount: ``{"type": ..., "value": n}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: str = Field(max_length=40)
    value: int = Field(ge=0)


class ClearToolUses(BaseModel):
    """``clear_tool_uses_20250919``: once the prompt reaches ``trigger``, the results of
    all but the ``keep`` latest tool uses are replaced with a placeholder (``_context``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["clear_tool_uses_20250919"]
    trigger: Count | None = Field(
        None, description="input_tokens (default 100,000) or tool_uses: when to clear"
    )
    keep: Count | None = Field(None, description="tool_uses: the latest to keep (default 3)")
    clear_at_least: Count | None = Field(
        None, description="input_tokens: clear nothing unless at least this many go"
    )
    exclude_tools: list[str] | None = Field(None, max_length=256)
    clear_tool_inputs: bool | list[str] | None = Field(
        None, description="also clear the calls' inputs (all, or those of these tools)"
    )

    def check(self, where: str) -> None:
        for name, kinds in (
            ("trigger", ("input_tokens", "tool_uses")),
            ("keep", ("tool_uses",)),
            ("clear_at_least", ("input_tokens",)),
        ):
            count = getattr(self, name)
            if count is not None and count.type not in kinds:
                raise UnsupportedParameter(
                    f"{where}.{name}.type",
                    f"{count.type!r}; it is {' or '.join(repr(k) for k in kinds)}",
                )


class ClearThinking(BaseModel):
    """``clear_thinking_20251015``: an earlier turn's thinking is never in the prompt
    here (thinking models' templates drop it), so there is nothing left to clear."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | Count | None = Field(
        None, description="which thinking turns to keep: earlier ones are left out anyway"
    )


ContextEdit = Annotated[ClearToolUses | ClearThinking, Field(discriminator="type")]


class ContextManagement(BaseModel):
    """``context_management``: Anthropic's context edits, applied to the prompt here
    (``_context``) and reported in the answer's ``context_management.applied_edits``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    edits: list[ContextEdit] = Field(default_factory=list, max_length=16)

    def check(self) -> None:
        for i, edit in enumerate(self.edits):
            if isinstance(edit, ClearToolUses):
                edit.check(f"context_management.edits[{i}]")


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


#: ``output_config.effort`` -> the share of ``max_tokens`` a thinking model may spend
#: reasoning (``high``, Anthropic's default, is the same as no effort: the server's own
#: budget, ``--reasoning-budget``, if it has one)
EFFORT_SHARES: dict[str, float | None] = {
    "low": 1 / 8,
    "medium": 1 / 4,
    "high": None,
    "xhigh": 3 / 4,
    "max": 1.0,
}


class OutputConfig(BaseModel):
    """``output_config``: ``effort`` and ``format``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None,
        description=(
            "a thinking model's reasoning budget, as a share of max_tokens: low 1/8, "
            "medium 1/4, high the server's (as no effort), xhigh 3/4, max all of it; "
            "thinking.budget_tokens, when sent, comes first. A model without a thinking "
            "phase answers the same at every effort, and its answer says so "
            "(tokenbelt.effort)"
        ),
    )

    format: OutputFormat | None = Field(
        None, description="json_schema: the answer validates against the schema"
    )

    def check(self) -> None:
        """Every value is taken (the type checks them)."""

    def budget(self, max_tokens: int) -> int | None:
        """The reasoning budget of ``effort`` for a reply of ``max_tokens``."""
        share = EFFORT_SHARES[self.effort] if self.effort is not None else None
        return None if share is None else max(1, int(max_tokens * share))
