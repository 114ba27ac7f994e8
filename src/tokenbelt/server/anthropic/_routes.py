"""Anthropic's Messages API, ``POST /v1/messages``, translated onto the shared request path.

A stream is Anthropic's sequence of server-sent events: ``message_start``,
``content_block_start``, ``content_block_delta`` (one per piece),
``content_block_stop``, ``message_delta`` (``stop_reason``, ``stop_sequence``,
``usage``) and ``message_stop``. ``stop_reason`` is ``end_turn``, ``stop_sequence``
or ``max_tokens`` for the model's own ends, as in Anthropic's API; a deadline gives
``timeout`` and a stop (cancel endpoint, shutdown) ``cancelled``, with the exact end
reason and trace in a ``tokenbelt`` object beside it. An engine failure is an
``error`` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import APIRouter
from starlette.responses import Response

from ...belt import EndReason
from ...engines import GenerationRequest
from ...runtime import Stream, sampling_from
from ..core import RELEASE_WAIT_S, Serving, compact_json, tokenbelt_final
from ._schemas import MessagesRequest, error_shape

PREFIX = "/v1/messages"
API = "anthropic"


def sse_event(event: object) -> bytes:
    """An ``(event name, data)`` pair as one named server-sent event."""
    name, data = cast(tuple[str, object], event)
    return f"event: {name}\ndata: {compact_json(data)}\n\n".encode()


def stop_reason(stream: Stream) -> str:
    reason = stream.end_reason or EndReason.RUNTIME_ERROR
    if reason is EndReason.LENGTH:
        return "max_tokens"
    if reason is EndReason.STOP:
        return "stop_sequence" if stream.trace.stop_sequence is not None else "end_turn"
    return "timeout" if reason.is_timeout else "cancelled"  # see the module docstring


def _message(stream: Stream, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": stream.request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": stream.trace.prompt_tokens, "output_tokens": 0},
    }


#: the Messages API, one module-level router (the serving core comes as ``Serving``)
router = APIRouter(tags=["anthropic"])


def _render(stream: Stream, model: str) -> dict[str, Any]:
    return {
        **_message(stream, model, [{"type": "text", "text": stream.text}]),
        "stop_reason": stop_reason(stream),
        "stop_sequence": stream.trace.stop_sequence,
        "usage": {
            "input_tokens": stream.trace.prompt_tokens,
            "output_tokens": stream.trace.completion_tokens,
        },
        "tokenbelt": tokenbelt_final(stream),
    }


async def _events(stream: Stream, model: str) -> AsyncIterator[object]:
    yield "message_start", {"type": "message_start", "message": _message(stream, model, [])}
    yield (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        },
    )
    error: str | None = None
    try:
        async for piece in stream:
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": piece},
                },
            )
    except Exception as exc:  # the engine failed: say so in the stream, then end it
        error = f"generation failed: {type(exc).__name__}: {exc}"
    await stream.await_released(RELEASE_WAIT_S)
    if error is not None:
        _, body = error_shape(500, error, "server_error", "runtime_error", None)
        yield "error", {**body, "tokenbelt": tokenbelt_final(stream)}
        return
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason(stream),
                "stop_sequence": stream.trace.stop_sequence,
            },
            "usage": {"output_tokens": stream.trace.completion_tokens},
            "tokenbelt": tokenbelt_final(stream),
        },
    )
    yield "message_stop", {"type": "message_stop"}


@router.post(PREFIX, summary="Anthropic Messages API (streaming with stream=true)")
async def messages(body: MessagesRequest, path: Serving) -> Response:
    model = path.state.model_for(body.model or None)
    request = GenerationRequest(messages=body.chat(), sampling=sampling_from(body.sampling()))
    stream = (await path.submit(model, request, body.tokenbelt, api=API)).stream
    # Anthropic's SDKs read the request id from ``request-id``.
    headers = {"request-id": stream.request_id}
    if body.stream:
        return path.streaming(
            stream, _events(stream, model.name), headers=headers, encode=sse_event
        )
    return path.answer(stream, lambda s: _render(s, model.name), shape=error_shape, headers=headers)
