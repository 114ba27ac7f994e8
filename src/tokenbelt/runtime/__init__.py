"""Layer 4: loaded models, slots, the admission queue and chat sessions (the SDK)."""

from ..engines import sampling_from
from ..models import DEFAULT_ALIAS
from ._model import Model, ModelState
from ._runtime import Runtime, check_n_ctx
from ._scheduler import Scheduler, SchedulerStatistics
from ._session import ChatSession
from ._stream import Reply, Stream, Usage
from ._structured import (
    CallStream,
    Tool,
    ToolCall,
    check_choice,
    new_call_id,
    parse_tool_calls,
    render_messages,
    tools_from,
    tools_grammar,
    tools_json,
)

__all__ = [
    "DEFAULT_ALIAS",
    "CallStream",
    "ChatSession",
    "Model",
    "ModelState",
    "Reply",
    "Runtime",
    "Scheduler",
    "SchedulerStatistics",
    "Stream",
    "Tool",
    "ToolCall",
    "Usage",
    "check_choice",
    "check_n_ctx",
    "new_call_id",
    "parse_tool_calls",
    "render_messages",
    "sampling_from",
    "tools_from",
    "tools_grammar",
    "tools_json",
]
