"""The OpenAI dialect's ``finish_reason``: tokenbelt's end reasons in OpenAI's vocabulary.

The mapping of the end reasons themselves stays ``EndReason.openai_finish_reason``: the
SDK's ``Reply.finish_reason`` (layer 4) gives the same value and cannot import a
dialect. What only the HTTP dialect knows, a reply that ended in a tool call, is added
here.
"""

from __future__ import annotations

from ...belt import EndReason
from ._tools import Plan


def finish_reason(reason: EndReason, plan: Plan | None = None) -> str:
    """One of OpenAI's own values: ``tool_calls`` when a reply with ``plan`` made a whole
    call and ended naturally, else ``EndReason.openai_finish_reason`` (the exact reason
    travels beside it, in ``tokenbelt.end_reason``)."""
    if plan is not None and plan.calls and not plan.cut and reason is EndReason.STOP:
        return "tool_calls"
    return reason.openai_finish_reason
