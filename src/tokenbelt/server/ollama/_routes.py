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

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any, Literal

import anyio
from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from ...belt import EndReason
from ...engines import GenerationRequest, Infill, Message, Piece
from ...runtime import Model, Stream, sampling_from
from ..core import (
    Calls,
    Fit,
    RequestPath,
    Serving,
    StreamEnd,
    Submitted,
    ToolPlan,
    UnsupportedParameter,
    ndjson,
    plan_tools,
    tokenbelt_final,
    until_end,
)
from . import _embed, _models
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


def _own(seconds: float | Literal[False] | None) -> float | Literal["default"] | None:
    """A request's own keep-alive as the runtime takes it: not given is the default."""
    return "default" if seconds is False else seconds


#: the Ollama routes, one module-level router (the serving core comes as ``Serving``)
router = APIRouter(prefix="/api", tags=["ollama"])


def _model_for(path: RequestPath, name: str) -> Model:
    return path.state.model_for(_models.local_name(path.state, name))


async def _load_or_unload(model: Model, body: _Generation, chat: bool) -> Response:
    """Ollama's way to load a model (no prompt), or unload it (``keep_alive: 0``)."""
    seconds = _keep_alive(model, body)
    unloads = seconds is not False and seconds == 0  # False: not given, a load
    # As Ollama has it, this request's keep_alive (or, not given, the server's) holds
    # from now on, until the next request brings its own; the server's default stays.
    # Before the load: an earlier request's 0 would unload the model this one loads.
    # (Loading only to unload would be a waste.)
    own = model.keep_alive if seconds is False else seconds
    await anyio.to_thread.run_sync(model.keep_loaded_for, own)
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
    thinking = {} if streamed or not stream.reasoning else {"thinking": stream.reasoning}
    message.update(thinking)
    if calls is not None:
        if not streamed:
            message.update(_tool_calls(calls))
        if calls.started is not None and calls.call is None:
            extension["cut_call"] = {"name": calls.started, "partial_arguments": calls.arguments}
        if calls.plan.with_tools:
            extension["tool_format"] = calls.plan.tool_format
    content = {"message": message} if chat else {"response": text, **thinking}
    return {
        "model": name,
        "created_at": now(),
        **content,
        "done": True,
        "done_reason": reason.value,
        **durations(submitted),
        "tokenbelt": extension,
    }


def _events(
    submitted: Submitted, name: str, chat: bool, plan: ToolPlan | None
) -> AsyncIterator[object]:
    """The NDJSON lines of a stream; the last one is always ``done: true`` with its
    ``done_reason`` (tokenbelt's exact reason), after an ``error`` line on a failure."""
    stream = submitted.stream
    calls = plan.calls() if plan is not None else None

    def chunk(text: str, **more: Any) -> dict[str, Any]:
        content: dict[str, Any] = (
            {"message": {"role": "assistant", "content": text, **more}}
            if chat
            else {"response": text}
        )
        return {"model": name, "created_at": now(), **content, "done": False}

    def thought(text: str) -> dict[str, Any]:
        if not chat:
            return {**chunk(""), "thinking": text}
        return chunk("", thinking=text)

    async def pieces() -> AsyncIterator[object]:
        async for piece in stream:
            if isinstance(piece, Piece) and piece.reasoning:
                yield thought(piece.reasoning)
                if not piece:
                    continue
            if calls is None:
                yield chunk(piece)
                continue
            for kind, text in calls.feed(piece):
                if kind == "content":
                    yield chunk(text)

    def end(how: StreamEnd) -> Iterator[object]:
        if how.error is not None:
            # The ``ollama`` client raises ``ResponseError`` for a line with ``error``;
            # a reader that goes on still gets the ``done`` line with the reason.
            yield {"error": how.error, "tokenbelt": tokenbelt_final(stream)}
        elif calls is not None:
            rest = "".join(text for kind, text in calls.finish() if kind == "content")
            if rest or calls.call is not None:
                yield chunk(rest, **_tool_calls(calls))
        yield _final(submitted, name, chat, "", calls, streamed=True)

    return until_end(stream, pieces(), end)


async def _run(
    path: RequestPath,
    model: Model,
    body: _Generation,
    request: GenerationRequest,
    chat: bool,
    plan: ToolPlan | None = None,
    fit: Fit | None = None,
) -> Response:
    seconds = _keep_alive(model, body)
    # This request's own keep_alive: 0 unloads the model once it is idle after this
    # request, unless a later request (any client's) brings its own or the default.
    submitted = await path.submit(
        model, request, body.tokenbelt, api=API, keep_alive=_own(seconds), fit=fit
    )
    stream = submitted.stream
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
    plan = plan_tools(
        body.turns(), body.tools or (), body.choice(), model.template_tools, model.tool_format
    )
    request = GenerationRequest(
        messages=plan.messages,
        sampling=sampling,
        grammar=plan.grammar or body.grammar(),
        tools=plan.tools_json,
    )
    # As Ollama does: the oldest turns go when the chat outgrows the window (num_ctx).
    fit = body.fit(model.context_length)
    return await _run(path, model, body, request, True, plan if plan.with_tools else None, fit)


@router.post("/generate", summary="Ollama: completion of a prompt (raw, or in the chat template)")
async def generate(body: GenerateRequest, path: Serving) -> Response:
    body.check_supported()
    model = _model_for(path, body.model)
    if not body.prompt:
        return await _load_or_unload(model, body, chat=False)
    sampling = sampling_from(body.sampling(model.context_length))
    if body.suffix is not None:
        # Fill in the middle (even with an empty suffix: the end of a file), from the
        # model's own FIM tokens; a model without them is a 400 naming what it lacks.
        if body.grammar() is not None:
            raise UnsupportedParameter("format", "with a suffix (a fill-in-the-middle prompt)")
        infill = Infill(prefix=body.prompt, suffix=body.suffix)
        request, _ = await anyio.to_thread.run_sync(model.infill_request, infill, sampling)
    elif body.raw:
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
router.include_router(_embed.router)
