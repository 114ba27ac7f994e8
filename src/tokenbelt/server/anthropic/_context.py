"""Anthropic's context edits, applied to a request's turns before its prompt is made.

``clear_tool_uses_20250919`` is a real prompt edit: once the prompt reaches its
``trigger`` (100,000 input tokens unless it says otherwise, or a count of tool uses),
the results of every tool use but the ``keep`` latest (3 by default) and those of
``exclude_tools`` are replaced by a placeholder, oldest first, and with
``clear_tool_inputs`` the calls' inputs too. If that clears fewer tokens than
``clear_at_least`` asks, nothing is cleared. What was cleared is reported as Anthropic
reports it: ``{"type", "cleared_tool_uses", "cleared_input_tokens"}`` in
``context_management.applied_edits``. The client keeps its whole history and sends it
again; the edit is made anew on each request.

``clear_thinking_20251015`` clears nothing here: an earlier turn's thinking is never in
the prompt (thinking models' templates drop it), so it is not an applied edit.

Turns are the OpenAI-shaped messages ``CountTokensRequest.turns`` makes: an assistant
turn's ``tool_calls`` and the ``tool`` turns that answer them by ``tool_call_id``.
Counting a prompt tokenizes it (``count``), so this runs off the event loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ._options import ClearToolUses, ContextManagement

#: what a cleared tool result reads as (the model learns that it was there)
CLEARED_RESULT = "[tool result cleared to save context]"
#: a cleared call's input
CLEARED_INPUT = "{}"
#: Anthropic's defaults for ``clear_tool_uses_20250919``
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP = 3

Turns = list[dict[str, Any]]


def apply(
    management: ContextManagement, turns: Turns, count: Callable[[Turns], int]
) -> tuple[Turns, list[dict[str, Any]]]:
    """``turns`` with every edit of ``management`` applied, and the applied edits."""
    applied: list[dict[str, Any]] = []
    for edit in management.edits:
        if isinstance(edit, ClearToolUses):
            turns, done = clear_tool_uses(edit, turns, count)
            if done is not None:
                applied.append(done)
    return turns, applied


def _uses(turns: Turns) -> list[tuple[int, int, str]]:
    """Each answered tool use, oldest first: (its call's turn, its result's turn, name)."""
    calls: dict[str, tuple[int, str]] = {}
    uses = []
    for i, turn in enumerate(turns):
        for call in turn.get("tool_calls") or ():
            calls[call["id"]] = (i, call["function"]["name"])
        if turn["role"] == "tool" and turn.get("tool_call_id") in calls:
            at, name = calls[turn["tool_call_id"]]
            uses.append((at, i, name))
    return uses


def clear_tool_uses(
    edit: ClearToolUses, turns: Turns, count: Callable[[Turns], int]
) -> tuple[Turns, dict[str, Any] | None]:
    """``turns`` with old tool results cleared when ``edit`` triggers; its report, or
    None when it cleared nothing."""
    uses = _uses(turns)
    if not uses:
        return turns, None
    trigger = edit.trigger
    before: int | None = None
    if trigger is not None and trigger.type == "tool_uses":
        if len(uses) < trigger.value:
            return turns, None
    else:
        before = count(turns)
        if before < (trigger.value if trigger is not None else DEFAULT_TRIGGER_TOKENS):
            return turns, None
    keep = edit.keep.value if edit.keep is not None else DEFAULT_KEEP
    excluded = set(edit.exclude_tools or ())
    old = uses[: len(uses) - keep] if keep else uses
    chosen = [use for use in old if use[2] not in excluded]
    if not chosen:
        return turns, None
    edited = copy.deepcopy(turns)
    inputs = edit.clear_tool_inputs
    for at, result, name in chosen:
        answered = edited[result]
        answered["content"] = CLEARED_RESULT
        if inputs is True or (isinstance(inputs, list) and name in inputs):
            for call in edited[at].get("tool_calls") or ():
                if call["id"] == answered["tool_call_id"]:
                    call["function"]["arguments"] = CLEARED_INPUT
    cleared = (count(turns) if before is None else before) - count(edited)
    least = edit.clear_at_least.value if edit.clear_at_least is not None else 0
    if cleared < least:
        return turns, None
    report = {
        "type": edit.type,
        "cleared_tool_uses": len(chosen),
        "cleared_input_tokens": max(cleared, 0),
    }
    return edited, report
