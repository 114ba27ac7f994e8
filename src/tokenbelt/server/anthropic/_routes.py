"""Anthropic's Messages API, ``POST /v1/messages``, translated onto the shared request path.

A stream is Anthropic's sequence of server-sent events: ``message_start``, then for
each content block ``content_block_start``, its ``content_block_delta`` events
(``text_delta`` pieces, or ``input_json_delta`` pieces whose concatenation is a
``tool_use`` block's input, or a thinking model's ``thinking_delta`` pieces in a
``thinking`` block before them) and ``content_block_stop``, then ``message_delta``
(``stop_reason``, ``stop_sequence``, ``usage``) and ``message_stop``. An engine failure
is an ``error`` event.

``stop_reason`` is always one of Anthropic's own values, with the exact end reason and
trace in a ``tokenbelt`` object beside it: ``end_turn``, ``stop_sequence`` or
``tool_use`` for the model's own ends, ``max_tokens`` for ``length``; an end the caller
chose (a cancel, a disconnect) is ``end_turn``, and one it did not (a deadline, a
shutdown) cut the reply short and is ``max_tokens``, as ``/v1`` answers ``stop`` and
``length`` for them. A call cut short is a ``tool_use`` block with the input sent so far
in a stream; in a whole answer it is no block (its input would not parse) and the
``tokenbelt`` object's ``cut_call`` has its name and the partial input.

``usage`` has Anthropic's meaning: ``cache_read_input_tokens`` are the prompt tokens
taken from the prefix cache, ``input_tokens`` the rest (the part computed for this
request); ``cache_creation_input_tokens`` is 0, since the cache keeps prompts on its own
and charges nothing for it. Their sum is the whole prompt, which
``POST /v1/messages/count_tokens`` counts exactly (the chat template and the tools
included), as Anthropic's does. A stream's ``message_start`` goes out before the engine
has looked in the cache (its split says nothing was read yet); ``message_delta`` carries
the final split, which Anthropic's SDKs take as the totals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import anyio
from fastapi import APIRouter
from starlette.responses import Response

from ..._errors import InvalidArgument
from ...belt import EndReason
from ...engines import GenerationRequest, Piece, SamplingParams
from ...runtime import Model, Stream, sampling_from
from ..core import (
    Calls,
    RequestPath,
    Serving,
    StreamEnd,
    ToolPlan,
    UnsupportedParameter,
    named_sse,
    plan_tools,
    think_said_as,
    tokenbelt_final,
    until_end,
)
from . import _context
from ._schemas import CountTokensRequest, MessagesRequest, error_shape

PREFIX = "/v1/messages"
API = "anthropic"

Event = tuple[str, dict[str, Any]]
#: what a stream writes while it has nothing to send (Anthropic's API sends the same)
PING = named_sse("ping", {"type": "ping"})


def sse_event(event: object) -> bytes:
    """An ``(event name, data)`` pair as one named server-sent event."""
    name, data = cast(Event, event)
    return named_sse(name, data)


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def stop_reason(stream: Stream, called: bool = False) -> str:
    """One of Anthropic's own values (see the module docstring)."""
    reason = stream.end_reason or EndReason.RUNTIME_ERROR
    if reason is EndReason.LENGTH:
        return "max_tokens"
    if reason is EndReason.STOP:
        if called:
            return "tool_use"
        return "stop_sequence" if stream.trace.stop_sequence is not None else "end_turn"
    # The ends a caller chose read as a finished turn, every other as a cut one.
    return "end_turn" if reason.openai_finish_reason == "stop" else "max_tokens"


@dataclasses.dataclass(frozen=True)
class Said:
    """What an answer says beyond the reply: in ``tokenbelt`` (how ``effort`` was
    taken), and at its top level (``context_management``: the applied edits)."""

    tokenbelt: dict[str, Any] = dataclasses.field(default_factory=dict)
    top: dict[str, Any] = dataclasses.field(default_factory=dict)


def _final(stream: Stream, plan: ToolPlan, calls: Calls, said: Said) -> dict[str, Any]:
    extension = tokenbelt_final(stream)
    extension.update(plan.extension())
    extension.update(said.tokenbelt)
    if calls.started is not None and calls.call is None:
        extension["cut_call"] = {"name": calls.started, "partial_input": calls.arguments}
    return extension


def _message(stream: Stream, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": stream.request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(stream, 0),
    }


def _usage(stream: Stream, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: the prompt split into what the cache gave and what was computed."""
    trace = stream.trace
    cached = min(trace.cached_tokens, trace.prompt_tokens)
    return {
        "input_tokens": trace.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


#: the Messages API, one module-level router (the serving core comes as ``Serving``)
router = APIRouter(tags=["anthropic"])


#: a thinking block's ``signature``: Anthropic's proves the thinking came from its model;
#: a local model's thinking has nothing to prove it by (clients send it back as is)
SIGNATURE = ""


def _thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": SIGNATURE}


def _render(stream: Stream, model: str, plan: ToolPlan, said: Said) -> dict[str, Any]:
    calls = plan.calls().whole(stream.text)
    content: list[dict[str, Any]] = []
    if stream.reasoning:
        content.append(_thinking_block(stream.reasoning))
    if calls.content or (calls.call is None and stream.trace.phase != "reasoning"):
        content.append({"type": "text", "text": calls.content})
    if calls.call is not None:
        use = {"id": tool_use_id(), "name": calls.call.name, "input": calls.call.args}
        content.append({"type": "tool_use", **use})
    return {
        **_message(stream, model, content),
        "stop_reason": stop_reason(stream, calls.call is not None),
        "stop_sequence": stream.trace.stop_sequence,
        "usage": _usage(stream, stream.trace.completion_tokens),
        **said.top,
        "tokenbelt": _final(stream, plan, calls, said),
    }


class _Blocks:
    """Content blocks as they open, fill and close, from ``Calls`` events."""

    def __init__(self) -> None:
        self.index = -1
        self._open: str | None = None

    def _start(self, block: dict[str, Any]) -> list[Event]:
        out = self.stop()
        self.index += 1
        self._open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": self.index,
            "delta": delta,
        }

    def text(self) -> list[Event]:
        """Open an empty text block."""
        return self._start({"type": "text", "text": ""})

    def thinking(self, text: str) -> list[Event]:
        """A thinking model's reasoning: its block (opened first), then its deltas."""
        out = self._start(_thinking_block("")) if self._open != "thinking" else []
        return [*out, self._delta({"type": "thinking_delta", "thinking": text})]

    def events(self, kind: str, text: str) -> list[Event]:
        if kind == "content":
            out = self.text() if self._open != "text" else []
            return [*out, self._delta({"type": "text_delta", "text": text})]
        if kind == "call":
            return self._start({"type": "tool_use", "id": tool_use_id(), "name": text, "input": {}})
        return [self._delta({"type": "input_json_delta", "partial_json": text})]

    @property
    def open(self) -> str | None:
        """The type of the block open now."""
        return self._open

    def stop(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _events(
    stream: Stream, model: str, plan: ToolPlan, thinks: bool, said: Said
) -> AsyncIterator[object]:
    """The named events of a stream; the last two are always ``message_delta`` (a
    standard ``stop_reason``, tokenbelt's exact reason in ``tokenbelt``) and
    ``message_stop``, after an ``error`` event on a failure. A thinking model's
    reasoning comes first, as ``thinking`` blocks."""
    calls, blocks = plan.calls(), _Blocks()

    async def pieces() -> AsyncIterator[object]:
        yield "message_start", {"type": "message_start", "message": _message(stream, model, [])}
        if not plan.with_tools and not thinks:
            # A text reply: its block opens at once, as Anthropic's does (a thinking
            # model's first block is its thinking, so its text block waits for the answer).
            for event in blocks.text():
                yield event
        async for piece in stream:
            if isinstance(piece, Piece) and piece.reasoning:
                for event in blocks.thinking(piece.reasoning):
                    yield event
                if not piece:
                    continue
            for kind, text in calls.feed(piece):
                for event in blocks.events(kind, text):
                    yield event

    def end(how: StreamEnd) -> Iterator[object]:
        if how.error is not None:
            yield from blocks.stop()
            _, body = error_shape(500, how.error, "server_error", "runtime_error", None)
            yield "error", {**body, "tokenbelt": tokenbelt_final(stream)}
        else:
            last = [e for kind, text in calls.finish() for e in blocks.events(kind, text)]
            if blocks.index < 0 and not last:  # nothing at all: one empty text block
                last = blocks.text()
            elif (
                thinks
                and not last
                and blocks.open == "thinking"
                and stream.trace.phase != "reasoning"
            ):
                last = blocks.text()  # the answer came empty: its block says so
            yield from [*last, *blocks.stop()]
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": stop_reason(stream, calls.call is not None),
                    "stop_sequence": stream.trace.stop_sequence,
                },
                "usage": _usage(stream, stream.trace.completion_tokens),
                **said.top,
                "tokenbelt": _final(stream, plan, calls, said),
            },
        )
        yield "message_stop", {"type": "message_stop"}

    return until_end(stream, pieces(), end)


def _plan(
    body: CountTokensRequest, model: Model, turns: list[dict[str, Any]] | None = None
) -> ToolPlan:
    """The request's plan: its ``turns`` (by default the body's own, unedited)."""
    body.check()
    plan = plan_tools(
        body.turns() if turns is None else turns,
        body.openai_tools(),
        body.openai_choice(),
        model.template_tools,
        model.tool_format,
    )
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is None:
        return plan
    if plan.with_tools:
        # One grammar shapes a reply: a call's, or the answer's schema.
        raise UnsupportedParameter(
            "output_config.format", "together with tools a model may call: send one or the other"
        )
    return dataclasses.replace(plan, grammar=fmt.grammar())


def _request(
    body: CountTokensRequest, plan: ToolPlan, sampling: SamplingParams
) -> GenerationRequest:
    """The request of a plan; a final assistant turn of text is continued (prefill)."""
    request = plan.request(sampling)
    if not body.continues_final():
        return request
    if plan.with_tools:
        raise UnsupportedParameter(
            f"messages[{len(body.messages) - 1}]",
            "a final assistant turn to continue (prefill) together with tools a model may "
            "call: send one or the other",
        )
    return dataclasses.replace(request, continue_final=True)


async def _edited(
    body: CountTokensRequest, model: Model, thinking: dict[str, object]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The body's turns with its context edits applied, and what the answer says of
    them (``context_management.applied_edits``; nothing if it sent none)."""
    turns = body.turns()
    management = body.context_management
    if management is None:
        return turns, {}

    def count(edited: list[dict[str, Any]]) -> int:
        request = _request(body, _plan(body, model, edited), sampling_from(thinking))
        return model.count_prompt_tokens(request)

    with _thinking_named():
        turns, applied = await anyio.to_thread.run_sync(_context.apply, management, turns, count)
    return turns, {"context_management": {"applied_edits": applied}}


def _effort(body: MessagesRequest, model: Model, path: RequestPath) -> dict[str, Any]:
    """How ``output_config.effort`` was taken, for ``tokenbelt.effort``: a thinking
    model's reasoning budget (``reasoning_budget``), or why the answer is the same at
    every effort (a model without a thinking phase...); empty without an effort."""
    config = body.output_config
    if config is None or config.effort is None:
        return {}
    why = None
    if not model.thinks:
        why = f"{model.name} has no thinking phase: its answer is the same at every effort"
    elif body.thinking is not None and body.thinking.type == "disabled":
        why = "thinking is disabled: there is no reasoning to budget"
    elif body.thinking is not None and body.thinking.budget_tokens is not None:
        why = "thinking.budget_tokens sets the reasoning budget"
    if why is not None:
        return {"effort": config.effort, "applied": False, "why": why}
    budget = config.budget(body.max_tokens)
    if budget is None:  # high: as no effort, the server's own budget
        budget = path.state.settings.reasoning_budget
    return {"effort": config.effort, "applied": True, "reasoning_budget": budget}


@router.post(PREFIX, summary="Anthropic Messages API (streaming with stream=true)")
async def messages(body: MessagesRequest, path: Serving) -> Response:
    model = path.state.model_for(body.model or None)
    body.check()
    sampling = body.sampling()
    effort = _effort(body, model, path)
    if effort.get("applied"):
        sampling["reasoning_budget"] = effort["reasoning_budget"]
    turns, top = await _edited(body, model, body.thinking_sampling())
    said = Said({"effort": effort} if effort else {}, top)
    plan = _plan(body, model, turns)
    request = _request(body, plan, sampling_from(sampling))
    with _thinking_named():
        stream = (await path.submit(model, request, body.tokenbelt, api=API)).stream
    # Anthropic's SDKs read the request id from ``request-id``.
    headers = {"request-id": stream.request_id}
    if body.stream:
        return path.streaming(
            stream,
            _events(stream, model.name, plan, model.thinks, said),
            headers=headers,
            encode=sse_event,
            keepalive=PING,
        )
    return path.answer(
        stream, lambda s: _render(s, model.name, plan, said), shape=error_shape, headers=headers
    )


@router.post(PREFIX + "/count_tokens", summary="Anthropic: the input tokens of a request")
async def count_tokens(body: CountTokensRequest, path: Serving) -> dict[str, Any]:
    """``{"input_tokens": n}``: the whole prompt the same ``/v1/messages`` request would
    have (its ``input_tokens`` plus ``cache_read_input_tokens``), its context edits
    applied."""
    model = path.state.model_for(body.model or None)
    body.check()
    # ``thinking`` shapes the prompt (a template's switch), so it is counted with it.
    thinking = body.thinking_sampling()
    turns, _ = await _edited(body, model, thinking)
    request = _request(body, _plan(body, model, turns), sampling_from(thinking))
    with _thinking_named():
        tokens = await anyio.to_thread.run_sync(model.count_prompt_tokens, request)
    return {"input_tokens": tokens}


@contextlib.contextmanager
def _thinking_named() -> Iterator[None]:
    """The engine names its own parameter, ``think``; this body said it as ``thinking``."""
    try:
        yield
    except InvalidArgument as exc:
        if exc.param != "think":
            raise
        why = think_said_as(exc, '{"type": "disabled"}')
        raise UnsupportedParameter("thinking.type", why) from None
