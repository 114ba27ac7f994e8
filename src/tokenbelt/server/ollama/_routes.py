"""The Ollama API: ``/api/chat`` and ``/api/generate`` translated onto the shared request path.

Streams are NDJSON (one JSON object a line, the last with ``done: true``) unless
``stream`` is false. The last object carries ``done_reason`` (``stop``, ``length``,
or the exact tokenbelt end reason, such as ``user_cancel`` or ``total_timeout``), the
durations Ollama reports (nanoseconds, from the request's trace) and a ``tokenbelt``
object with the end reason and the trace. The model routes live in ``_models``.
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
from ...runtime import Model, sampling_from
from ..core import (
    RELEASE_WAIT_S,
    RequestPath,
    Serving,
    Submitted,
    UnsupportedParameter,
    ndjson,
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


def _final(submitted: Submitted, name: str, chat: bool, text: str) -> dict[str, Any]:
    stream = submitted.stream
    reason = stream.end_reason or EndReason.RUNTIME_ERROR
    content = {"message": {"role": "assistant", "content": text}} if chat else {"response": text}
    return {
        "model": name,
        "created_at": now(),
        **content,
        "done": True,
        "done_reason": reason.value,
        **durations(submitted),
        "tokenbelt": tokenbelt_final(stream),
    }


async def _events(submitted: Submitted, name: str, chat: bool) -> AsyncIterator[object]:
    stream = submitted.stream
    error: str | None = None
    try:
        async for piece in stream:
            content: dict[str, Any] = (
                {"message": {"role": "assistant", "content": piece}}
                if chat
                else {"response": piece}
            )
            yield {"model": name, "created_at": now(), **content, "done": False}
    except Exception as exc:  # the engine failed: say so in the stream, then end it
        error = f"generation failed: {type(exc).__name__}: {exc}"
    await stream.await_released(RELEASE_WAIT_S)
    if error is not None:
        # The ``ollama`` client raises ``ResponseError`` for a line with ``error``.
        yield {"error": error, "tokenbelt": tokenbelt_final(stream)}
        return
    yield _final(submitted, name, chat, "")


async def _run(
    path: RequestPath, model: Model, body: _Generation, request: GenerationRequest, chat: bool
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
            _events(submitted, model.name, chat),
            encode=ndjson,
            media_type=NDJSON,
        )
    return path.answer(
        stream,
        lambda s: _final(submitted, model.name, chat, s.text),
        shape=error_shape,
    )


@router.post("/chat", summary="Ollama: chat (NDJSON stream unless stream is false)")
async def chat(body: ChatRequest, path: Serving) -> Response:
    body.check_supported()
    model = _model_for(path, body.model)
    if not body.messages:
        return await _load_or_unload(model, body, chat=True)
    messages: tuple[Message, ...] = tuple(
        {"role": m.role, "content": m.content} for m in body.messages
    )
    sampling = sampling_from(body.sampling(model.context_length))
    request = GenerationRequest(messages=messages, sampling=sampling, grammar=body.grammar())
    return await _run(path, model, body, request, True)


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
