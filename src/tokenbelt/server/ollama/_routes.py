"""The Ollama API: ``/api/chat`` and ``/api/generate`` translated onto the shared request path.

Streams are NDJSON (one JSON object a line, the last with ``done: true``) unless
``stream`` is false. The last object carries ``done_reason`` (``stop``, ``length``,
or the exact tokenbelt end reason, such as ``user_cancel`` or ``total_timeout``), the
durations Ollama reports (nanoseconds, from the request's trace) and a ``tokenbelt``
object with the end reason and the trace. The model routes live in ``_models``.

With ``tools``, a reply's call is ``message.tool_calls`` (``function``: ``index``,
``name``, ``arguments`` as an object), and a stream sends it whole in one chunk once it
is complete, after the text before it, as Ollama does. A call cut short (``length``, a
cancel) is no call: it is left out of ``content`` too, and the ``tokenbelt`` object's
``cut_call`` has its name and the partial arguments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, Literal

import anyio
from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from ...belt import EndReason
from ...engines import GenerationRequest, Message
from ...runtime import Model, Stream, sampling_from
from ..core import (
    RELEASE_WAIT_S,
    Calls,
    RequestPath,
    Serving,
    Submitted,
    ToolPlan,
    UnsupportedParameter,
    ndjson,
    plan_tools,
    tokenbelt_final,
)
from . import _models
from ._schemas import ChatRequest, GenerateRequest, _Generation, error_shape

PREFIX = "/api/"
API = "ollama"
NDJSON = "application/x-ndjson"


def now() -> str:
    """A timestamp as Ollama writes ``created_at`` (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return 0 if seconds is None else max(0, round(seconds * 1e9))


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def durations(submitted: Submitted) -> dict[str, int]:
    """Ollama's counters and durations (nanoseconds) from the request's trace.

    Prompt evaluation runs from admission to the first token; evaluation from the
    first token to the last; the total from enqueue to release, plus any reload.
    """
    t = submitted.stream.trace
    load = submitted.load_s
    total = (t.end_to_end or 0.0) + load
    return {
        "total_duration": _ns(total),
        "load_duration": _ns(load),
        "prompt_eval_count": t.prompt_tokens,
        "prompt_eval_duration": _ns(_span(t.admitted, t.first_token)),
        "eval_count": t.completion_tokens,
        "eval_duration": _ns(_span(t.first_token, t.last_token)),
    }


def _keep_alive(model: Model, body: _Generation) -> float | Literal[False] | None:
    """``keep_alive`` in seconds (False: not given), refused before anything runs if the
    model could not be loaded again after an unload."""
    seconds = body.keep_alive_seconds()
    if seconds is not False and not model.reloadable:
        raise UnsupportedParameter(
            "keep_alive", f"model {model.name} was given ready-made engines and stays loaded"
        )
    return seconds


def _apply_keep_alive(model: Model, seconds: float | Literal[False] | None) -> None:
    """Blocking: ``0`` unloads an idle model before it returns."""
    if seconds is not False:
        model.set_keep_alive(seconds)


#: the Ollama routes, one module-level router (the serving core comes as ``Serving``)
router = APIRouter(prefix="/api", tags=["ollama"])


def _model_for(path: RequestPath, name: str) -> Model:
    return path.state.model_for(_models.local_name(path.state, name))


async def _load_or_unload(model: Model, body: _Generation, chat: bool) -> Response:
    """Ollama's way to load a model (no prompt), or unload it (``keep_alive: 0``)."""
    seconds = _keep_alive(model, body)
    unloads = seconds is not False and seconds == 0  # False: not given, a load
    # The new keep_alive first: applied after the load, an earlier 0 would unload
    # the model this request just loaded. (Loading only to unload would be a waste.)
    await anyio.to_thread.run_sync(_apply_keep_alive, model, seconds)
    if not unloads:
        await anyio.to_thread.run_sync(model.ensure_loaded)
    content = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return JSONResponse(
        {
            "model": model.name,
            "created_at": now(),
            **content,
            "done": True,
            "done_reason": "unload" if unloads else "load",
        }
    )


def _tool_calls(calls: Calls) -> dict[str, Any]:
    """``tool_calls`` of a message, Ollama-shaped; nothing without a finished call."""
    if calls.call is None:
        return {}
    fn = {"index": 0, "name": calls.call.name, "arguments": calls.call.args}
    return {"tool_calls": [{"function": fn}]}


def _final(
    submitted: Submitted,
    name: str,
    chat: bool,
    text: str,
    calls: Calls | None = None,
    streamed: bool = False,
) -> dict[str, Any]:
    """The last object; a stream sent its call in a chunk of its own before it."""
    stream = submitted.stream
    reason = stream.end_reason or EndReason.RUNTIME_ERROR
    extension = tokenbelt_final(stream)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls is not None:
        if not streamed:
            message.update(_tool_calls(calls))
        if calls.started is not None and calls.call is None:
            extension["cut_call"] = {"name": calls.started, "partial_arguments": calls.arguments}
        if calls.plan.with_tools:
            extension["tool_format"] = calls.plan.tool_format
    content = {"message": message} if chat else {"response": text}
    return {
        "model": name,
        "created_at": now(),
        **content,
        "done": True,
        "done_reason": reason.value,
        **durations(submitted),
        "tokenbelt": extension,
    }


async def _events(
    submitted: Submitted, name: str, chat: bool, plan: ToolPlan | None
) -> AsyncIterator[object]:
    stream = submitted.stream
    calls = plan.calls() if plan is not None else None

    def chunk(text: str, **more: Any) -> dict[str, Any]:
        content: dict[str, Any] = (
            {"message": {"role": "assistant", "content": text, **more}}
            if chat
            else {"response": text}
        )
        return {"model": name, "created_at": now(), **content, "done": False}

    error: str | None = None
    try:
        async for piece in stream:
            if calls is None:
                yield chunk(piece)
                continue
            for kind, text in calls.feed(piece):
                if kind == "content":
                    yield chunk(text)
    except Exception as exc:  # the engine failed: say so in the stream, then end it
        error = f"generation failed: {type(exc).__name__}: {exc}"
    await stream.await_released(RELEASE_WAIT_S)
    if error is not None:
        # The ``ollama`` client raises ``ResponseError`` for a line with ``error``.
        yield {"error": error, "tokenbelt": tokenbelt_final(stream)}
        return
    if calls is not None:
        rest = "".join(text for kind, text in calls.finish() if kind == "content")
        if rest or calls.call is not None:
            yield chunk(rest, **_tool_calls(calls))
    yield _final(submitted, name, chat, "", calls, streamed=True)


async def _run(
    path: RequestPath,
    model: Model,
    body: _Generation,
    request: GenerationRequest,
    chat: bool,
    plan: ToolPlan | None = None,
) -> Response:
    seconds = _keep_alive(model, body)
    submitted = await path.submit(model, request, body.tokenbelt, api=API)
    stream = submitted.stream
    try:
        # After the submit: the model is busy now, so 0 unloads it once this is released.
        await anyio.to_thread.run_sync(_apply_keep_alive, model, seconds)
    except BaseException:
        stream.cancel()
        raise
    if body.stream:
        return path.streaming(
            stream,
            _events(submitted, model.name, chat, plan),
            encode=ndjson,
            media_type=NDJSON,
            keepalive=None,  # a blank line is not a JSON object to Ollama's clients
        )

    def render(s: Stream) -> dict[str, Any]:
        if plan is None:
            return _final(submitted, model.name, chat, s.text)
        calls = plan.calls().whole(s.text)
        return _final(submitted, model.name, chat, calls.content, calls)

    return path.answer(stream, render, shape=error_shape)


@router.post("/chat", summary="Ollama: chat (NDJSON stream unless stream is false)")
async def chat(body: ChatRequest, path: Serving) -> Response:
    body.check_supported()
    model = _model_for(path, body.model)
    if not body.messages:
        return await _load_or_unload(model, body, chat=True)
    sampling = sampling_from(body.sampling(model.context_length))
    # Through the planner even without tools: a conversation that called tools earlier
    # keeps its calls and results in the prompt format the model was shown them in.
    plan = plan_tools(body.turns(), body.tools or (), None, model.template_tools, model.tool_format)
    request = GenerationRequest(
        messages=plan.messages,
        sampling=sampling,
        grammar=plan.grammar or body.grammar(),
        tools=plan.tools_json,
    )
    return await _run(path, model, body, request, True, plan if plan.with_tools else None)


@router.post("/generate", summary="Ollama: completion of a prompt (raw, or in the chat template)")
async def generate(body: GenerateRequest, path: Serving) -> Response:
    body.check_supported()
    model = _model_for(path, body.model)
    if not body.prompt:
        return await _load_or_unload(model, body, chat=False)
    sampling = sampling_from(body.sampling(model.context_length))
    if body.raw:
        request = GenerationRequest(prompt=body.prompt, sampling=sampling, grammar=body.grammar())
    else:
        messages: list[Message] = []
        if body.system:
            messages.append({"role": "system", "content": body.system})
        messages.append({"role": "user", "content": body.prompt})
        request = GenerationRequest(
            messages=tuple(messages), sampling=sampling, grammar=body.grammar()
        )
    return await _run(path, model, body, request, False)


router.include_router(_models.router)
