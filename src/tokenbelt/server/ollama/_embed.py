"""Ollama's embeddings: ``POST /api/embed`` and the legacy ``POST /api/embeddings``.

Both take the request path every generation takes (queue, deadlines, stop, trace).
``/api/embed`` answers ``embeddings`` (unit-length vectors, one per input) with
Ollama's counters (an empty ``input`` loads the model and answers none, as Ollama
does); ``/api/embeddings`` answers one ``embedding``, not normalised, as
Ollama's legacy route does. ``truncate`` is Ollama's (true by default); with it false,
an input longer than the model embeds is a 400 naming it. ``keep_alive`` applies as
on ``/api/chat``: to that request only (the server's default changes only through the
admin route).
"""

from __future__ import annotations

from typing import Any, Literal

import anyio
from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from ..._errors import InvalidArgument
from ...runtime import Embeddings, Model
from ..core import (
    RequestPath,
    Serving,
    UnsupportedParameter,
    answer_embedding,
    check_dimensions,
    encode_vector,
    shrink,
    submit_embedding,
)
from . import _models
from ._schemas import EmbedRequest, LegacyEmbedRequest, error_shape

API = "ollama"

router = APIRouter()


def _ns(seconds: float | None) -> int:
    return 0 if seconds is None else max(0, round(seconds * 1e9))


def _keep_alive(model: Model, seconds: float | Literal[False] | None) -> float | None:
    """This request's own keep-alive (not given: the model's), as on ``/api/chat``; it
    changes no default. Refused before anything runs if the model could not be loaded
    again after an unload."""
    if seconds is False:
        return model.keep_alive
    if not model.reloadable:
        raise UnsupportedParameter(
            "keep_alive", f"model {model.name} was given ready-made engines and stays loaded"
        )
    return seconds


async def _own_keep_alive(model: Model, seconds: float | Literal[False] | None) -> None:
    """Before the submit: this request's keep-alive holds once it is done, until a later
    request (any client's) brings its own or the default."""
    own: float | Literal["default"] | None = (
        "default" if seconds is False else _keep_alive(model, seconds)
    )
    await anyio.to_thread.run_sync(model.keep_alive_for_request, own)


async def _load_or_unload(model: Model, seconds: float | Literal[False] | None) -> None:
    """Ollama's empty ``input``: load the model, or unload it (``keep_alive: 0``), as
    ``/api/chat`` does without messages."""
    own = _keep_alive(model, seconds)
    await anyio.to_thread.run_sync(model.keep_loaded_for, own)
    if seconds is False or seconds != 0:  # loading only to unload would be a waste
        await anyio.to_thread.run_sync(model.ensure_loaded)


def _model(path: RequestPath, name: str) -> Model:
    return path.state.model_for(_models.local_name(path.state, name))


@router.post("/embed", summary="Ollama: embeddings of one input or many")
async def embed(body: EmbedRequest, path: Serving) -> Response:
    body.check_supported()
    model = _model(path, body.model)
    check_dimensions(model, body.dimensions)
    seconds = body.keep_alive_seconds()
    inputs = body.inputs()
    if not inputs:  # a preload: the model is loaded (or unloaded), nothing is embedded
        await _load_or_unload(model, seconds)
        empty = {"model": model.name, "embeddings": [], "total_duration": 0}
        return JSONResponse({**empty, "load_duration": 0, "prompt_eval_count": 0})

    def make(**queue: Any) -> Any:
        return model.embeddings(inputs, truncate=body.truncate, window=body.window(), **queue)

    await _own_keep_alive(model, seconds)
    stream = await submit_embedding(path, model, make, body.tokenbelt, api=API)

    def render(done: Embeddings) -> dict[str, Any]:
        t = done.trace
        return {
            "model": model.name,
            "embeddings": [encode_vector(r, "float") for r in shrink(done.array, body.dimensions)],
            "total_duration": _ns(t.end_to_end),
            "load_duration": 0,
            "prompt_eval_count": done.usage.prompt_tokens,
        }

    return answer_embedding(stream, render, shape=error_shape)


@router.post("/embeddings", summary="Ollama: the legacy embedding of one prompt")
async def embeddings(body: LegacyEmbedRequest, path: Serving) -> Response:
    body.check_supported()
    if not isinstance(body.prompt, str):
        raise InvalidArgument("prompt must be a string", param="prompt")
    model = _model(path, body.model)
    seconds = body.keep_alive_seconds()
    prompt = body.prompt

    def make(**queue: Any) -> Any:
        return model.embeddings(
            [prompt], normalize=False, truncate=True, window=body.window(), **queue
        )

    await _own_keep_alive(model, seconds)
    stream = await submit_embedding(path, model, make, body.tokenbelt, api=API)

    def render(done: Embeddings) -> dict[str, Any]:
        return {"embedding": encode_vector(done.array[0], "float")}

    return answer_embedding(stream, render, shape=error_shape)
