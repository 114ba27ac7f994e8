"""The OpenAI dialect: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``.

Handlers are module-level functions on ``router``; each is given the serving core
(``Serving``) and only translates: bodies to generation requests, streams to OpenAI's
chunks and answers. ``n`` choices are one request each, read together. A reply's
``finish_reason`` is one of OpenAI's own values (``_reasons``); the exact end reason
travels beside it in ``tokenbelt``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, cast

import anyio
from fastapi import APIRouter, Header
from starlette.responses import JSONResponse, Response

from ..._errors import InvalidArgument
from ...belt import EndReason
from ...engines import GenerationRequest, Infill, Piece, SamplingParams
from ...runtime import Claim, Model, ModelState, Stream, sampling_from
from ..core import (
    RELEASE_WAIT_S,
    RequestPath,
    ServerState,
    Serving,
    UnsupportedParameter,
    error_body,
    error_response,
    failure,
    openai_shape,
    public,
    think_said_as,
    tokenbelt_final,
    with_progress,
)
from . import _audio, _embeddings, _tools
from ._choices import Choice, chat_logprobs, legacy_logprobs, messages_for, pieces
from ._reasons import finish_reason
from ._schemas import ChatCompletionRequest, CompletionRequest, _Sampling

API = "openai"
#: a caller's own request id (a front tokenbelt passes its id on to its upstream)
# The header is the parameter's own name (x_request_id -> x-request-id): an alias here made
# pydantic warn, in the request that first built the route, that it has no effect.
_REQUEST_ID = Header(
    None,
    description="use this request id (letters, digits, ._:-, at most 64) if it is new",
)

#: the OpenAI routes, one module-level router (the serving core comes as ``Serving``)
router = APIRouter()


def _prompt(body: CompletionRequest) -> str | tuple[int, ...]:
    """The one prompt of a body: text, or token ids (a list of them, or a list holding
    one such list, as OpenAI's API takes them)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(token, int) for token in prompt):
        return tuple(cast(list[int], prompt))
    if len(prompt) != 1:
        raise InvalidArgument(
            "prompt must be one prompt: a string or a list of token ids (a list of prompts "
            "must hold exactly one)",
            param="prompt",
        )
    one = cast(str | list[int], prompt[0])
    return one if isinstance(one, str) else tuple(one)


def _sampling_for(body: _Sampling, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: with a ``seed``, each choice takes the next one, so
    the choices differ and the answer still repeats."""
    params = body.sampling()
    if index and body.seed is not None:
        params["seed"] = (body.seed + index) % 2**32
    return sampling_from(params)


def _model_entry(name: str, **tokenbelt: Any) -> dict[str, Any]:
    """One model, in OpenAI's shape and Anthropic's at once (the same path serves both
    SDKs' ``models.list``; each reads its own fields)."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "tokenbelt",
        "type": "model",
        "display_name": name,
        "created_at": "1970-01-01T00:00:00Z",
        "tokenbelt": tokenbelt,
    }


# -- models ----------------------------------------------------------------------------------


def _served_entry(state: ServerState, name: str) -> dict[str, Any]:
    model = state.runtime.models.get(name)
    status = state.loads.get(name)
    # No path of the server's files unless the admin key asked (``public``).
    return _model_entry(
        name,
        loaded=model is not None and model.state is ModelState.READY,
        cached=True,
        state=model.state.value if model else (status.state if status else None),
        load=public(status.to_dict()) if status else None,
        context_length=model.context_length if model else None,
        slots=model.status().slots if model else None,
        # suffix on /v1/completions, /infill: known once the model was loaded
        fill_in_the_middle=model.fills_middle if model else None,
        info=public(model.info) if model else {},
    )


def _served(state: ServerState, name: str) -> bool:
    status = state.loads.get(name)
    return name in state.runtime.models or (status is not None and status.state == "loading")


@router.get("/v1/models", summary="The models this server serves (loaded or loading)")
async def list_models(path: Serving) -> dict[str, Any]:
    """``data`` lists only what a request may name now or once loaded; a failed load
    and the catalog's aliases this server could be started with are in
    ``tokenbelt.not_served``, where no OpenAI client looks for models."""
    state = path.state
    catalog = {c["alias"]: c for c in await anyio.to_thread.run_sync(state.catalog)}
    data: list[dict[str, Any]] = []
    not_served: list[dict[str, Any]] = []
    for name in state.model_names():
        (data if _served(state, name) else not_served).append(_served_entry(state, name))
    known = {d["id"] for d in data + not_served}
    for alias, entry in catalog.items():
        if alias not in known:
            not_served.append(
                _model_entry(
                    alias,
                    loaded=False,
                    cached=entry["cached"],
                    state="available",
                    load={"state": "available", "error": None, "elapsed_s": 0.0},
                    context_length=entry["context_length"],
                    slots=None,
                    info={},
                )
            )
    return {
        "object": "list",
        "data": data,
        # Anthropic's page fields: every model is on this one page
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "tokenbelt": {"not_served": not_served},
    }


@router.get("/v1/models/{model_id:path}", summary="One model this server serves")
async def retrieve_model(model_id: str, path: Serving) -> JSONResponse:
    name = path.state.runtime.name_for(model_id)
    if not _served(path.state, name):
        return error_response(
            404,
            f"this server does not serve a model {model_id!r}",
            "invalid_request_error",
            "model_not_found",
            param="model",
        )
    return JSONResponse(_served_entry(path.state, name))


# -- requests --------------------------------------------------------------------------------


async def _submit(
    path: RequestPath,
    model: Model,
    body: _Sampling,
    requests: list[GenerationRequest],
    request_id: str | None,
    supersede: Claim | None = None,
) -> list[Choice]:
    """One request per choice (``n``); a refusal of any of them ends them all. With a
    ``supersede`` claim, every choice is held by it (a newer request ends them all)."""
    choices: list[Choice] = []
    try:
        for i, request in enumerate(requests):
            submitted = await path.submit(
                model,
                request,
                body.tokenbelt,
                api=API,
                request_id=request_id if not i else None,
                supersede=supersede,
            )
            choices.append(Choice(i, submitted.stream))
    except BaseException:
        for choice in choices:
            choice.stream.cancel(EndReason.REJECTED)
        raise
    return choices


async def _prompt_ids(
    model: Model, body: _Sampling, request: GenerationRequest
) -> list[int] | None:
    """With ``return_token_ids``: the prompt's token ids (off the event loop), else None."""
    if not body.return_token_ids:
        return None
    return await anyio.to_thread.run_sync(model.prompt_token_ids, request)


def _usage(choices: list[Choice]) -> dict[str, Any]:
    """The prompt once, the completions of every choice."""
    usage = choices[0].stream.usage.to_dict()
    completion = sum(c.stream.usage.completion_tokens for c in choices)
    usage["completion_tokens"] = completion
    usage["total_tokens"] = usage["prompt_tokens"] + completion
    if "completion_tokens_details" in usage:
        reasoning = sum(c.stream.usage.reasoning_tokens or 0 for c in choices)
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _reasoning(text: str) -> dict[str, str]:
    """A thinking model's reasoning text under both names clients read: llama.cpp's
    and DeepSeek's ``reasoning_content``, vLLM's and Ollama's ``reasoning``."""
    return {"reasoning_content": text, "reasoning": text}


def _final(choices: list[Choice], plans: dict[int, _tools.Plan]) -> dict[str, Any]:
    """``tokenbelt`` of the last chunk or the answer: the first choice's, and with ``n``
    each choice's end and schema check."""
    extension = tokenbelt_final(choices[0].stream)
    extension.update(plans[choices[0].index].extension())
    if len(choices) > 1:
        extension["choices"] = [
            {
                "index": c.index,
                "request_id": c.stream.request_id,
                "end_reason": (c.stream.end_reason or EndReason.RUNTIME_ERROR).value,
                **{k: v for k, v in plans[c.index].extension().items() if k != "grammar"},
            }
            for c in choices
        ]
    return extension


async def _events(
    choices: list[Choice],
    model: str,
    body: _Sampling,
    chat: bool,
    echo: str | None,
    plans: dict[int, _tools.Plan],
    prompt_ids: list[int] | None,
) -> AsyncIterator[object]:
    base = {
        "id": choices[0].stream.request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    scored = bool(body.sampling().get("logprobs"))
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    # vLLM's shape: the prompt's ids once (a chat's first chunk; each choice's first
    # chunk in completions), then each chunk's own new token ids.
    prompt_pending = {c.index: prompt_ids is not None for c in choices}
    chat_prompt_pending = prompt_ids is not None

    def extras(choice: Choice, out: dict[str, Any]) -> None:
        if prompt_ids is None:
            return
        if not chat and prompt_pending[choice.index]:
            out["prompt_token_ids"] = prompt_ids
            prompt_pending[choice.index] = False
        out["token_ids"] = choice.new_token_ids()

    def envelope(out: dict[str, Any]) -> dict[str, Any]:
        """``base`` for one chunk: the prompt's ids on a chat's first, usage when asked."""
        nonlocal chat_prompt_pending
        head: dict[str, Any] = dict(base)
        if chat and chat_prompt_pending:
            head["prompt_token_ids"] = prompt_ids
            chat_prompt_pending = False
        head.update(out)
        if continuous:
            head["usage"] = _usage(choices)
        return head

    offsets = dict.fromkeys((c.index for c in choices), len(echo) if echo else 0)
    deltas = {c.index: _tools.Deltas(plans[c.index]) for c in choices}

    def logprobs(choice: Choice) -> dict[str, Any]:
        if not scored:
            return {}
        fresh = choice.new_logprobs()
        if chat:
            return {"logprobs": chat_logprobs(fresh)}
        lp = legacy_logprobs(fresh, offsets[choice.index])
        offsets[choice.index] += sum(len(t.token) for t in fresh)
        return {"logprobs": lp}

    def chunk(c: Choice, delta: dict[str, Any] | None, piece: str = "") -> dict[str, Any]:
        if delta is not None:
            if c.first:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {"index": c.index, "delta": delta, "finish_reason": None}
        else:
            choice = {"index": c.index, "text": piece, "finish_reason": None}
        choice.update(logprobs(c))
        extras(c, choice)
        c.first = False
        stream = c.stream
        stats = stream.statistics()
        return envelope(
            {
                "choices": [choice],
                "tokenbelt": {
                    "buffered": stats.buffered,
                    "capacity": stats.capacity,
                    "completion_tokens": stream.trace.completion_tokens,
                },
            }
        )

    if echo is not None:
        for c in choices:
            echoed: dict[str, Any] = {"index": c.index, "text": echo, "finish_reason": None}
            extras(c, echoed)
            yield envelope({"choices": [echoed]})
    async for c, piece in pieces(choices):
        if piece is not None:
            if chat:
                if isinstance(piece, Piece) and piece.reasoning:
                    yield chunk(c, _reasoning(piece.reasoning))
                    if not piece:
                        continue
                for delta in deltas[c.index].feed(piece):
                    yield chunk(c, delta)
            else:
                yield chunk(c, None, piece)
            continue
        # This choice ended: its last deltas, then its last chunk.
        stream = c.stream
        await stream.await_released(RELEASE_WAIT_S)
        reason = stream.end_reason or EndReason.RUNTIME_ERROR
        if chat:
            for delta in deltas[c.index].finish(ended_early=reason is not EndReason.STOP):
                yield chunk(c, delta)
        last: dict[str, Any] = {
            "index": c.index,
            "finish_reason": finish_reason(reason, plans[c.index]),
            **logprobs(c),
            **({"delta": {}} if chat else {"text": ""}),
        }
        extras(c, last)
        final: dict[str, Any] = envelope({"choices": [last], "tokenbelt": _final([c], plans)})
        if c.failed is not None:
            _status, type_, code = failure(c.failed)
            error = f"{type(c.failed).__name__}: {c.failed}"
            final["error"] = error_body(error, type_, code)["error"]
        yield final
    if body.stream_options and body.stream_options.include_usage:
        yield {**base, "choices": [], "usage": _usage(choices)}
    yield "[DONE]"


def _respond(
    path: RequestPath,
    choices: list[Choice],
    body: _Sampling,
    model: Model,
    chat: bool,
    echo: str | None = None,
    plan: _tools.Plan | None = None,
    prompt_ids: list[int] | None = None,
) -> Response:
    # Each choice parses its own calls: a plan of its own.
    base_plan = plan or _tools.Plan(())
    plans = {c.index: dataclasses.replace(base_plan, calls=[]) for c in choices}
    first, others = choices[0].stream, [c.stream for c in choices[1:]]
    if body.stream:
        events = _events(choices, model.name, body, chat, echo, plans, prompt_ids)
        if body.return_progress:
            head: dict[str, Any] = {
                "id": first.request_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": model.name,
                "choices": [],
            }
            events = with_progress(first.trace, events, lambda p: {**head, "prompt_progress": p})
        return path.streaming(first, events, also=others)
    scored = bool(body.sampling().get("logprobs"))

    def one(c: Choice) -> dict[str, Any]:
        s = c.stream
        end = s.end_reason or EndReason.RUNTIME_ERROR
        reason = finish_reason(end)
        if chat:
            message = _tools.message(s.text, plans[c.index], end is not EndReason.STOP)
            if s.reasoning:
                message.update(_reasoning(s.reasoning))
            choice: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "finish_reason": finish_reason(end, plans[c.index]),
            }
            if scored:
                choice["logprobs"] = chat_logprobs(s.logprobs)
            if prompt_ids is not None:
                choice["token_ids"] = s.token_ids
            return choice
        choice = {"index": c.index, "text": (echo or "") + s.text, "finish_reason": reason}
        if scored:
            choice["logprobs"] = legacy_logprobs(s.logprobs, len(echo or ""))
        if prompt_ids is not None:
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = s.token_ids
        return choice

    def render(s: Stream) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "id": s.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model.name,
            "choices": [one(c) for c in choices],
            "usage": _usage(choices),
            "tokenbelt": _final(choices, plans),
        }
        if chat and prompt_ids is not None:
            answer["prompt_token_ids"] = prompt_ids
        return answer

    return path.answer(first, render, shape=openai_shape, also=others)


@router.post("/v1/chat/completions", summary="Chat completion (streaming with stream=true)")
async def chat_completions(
    body: ChatCompletionRequest, path: Serving, x_request_id: str | None = _REQUEST_ID
) -> Response:
    model = path.state.model_for(body.model)
    messages = messages_for(body.messages, model.name)
    plan = _tools.plan(
        messages,
        body.response_format,
        body.tools,
        body.tool_choice,
        model.template_tools,
        model.tool_format,
    )
    requests = [
        GenerationRequest(
            messages=plan.messages,
            sampling=_sampling_for(body, i),
            grammar=plan.grammar,
            tools=plan.tools_json,
            reuse_prefix=body.cache_prompt,
        )
        for i in range(body.n)
    ]
    prompt_ids = await _prompt_ids(model, body, requests[0])
    try:
        choices = await _submit(path, model, body, requests, x_request_id)
    except InvalidArgument as exc:
        if exc.param != "think" or body.reasoning_effort is None:
            raise
        # The engine names its own parameter; this body said it as reasoning_effort.
        raise InvalidArgument(
            f"reasoning_effort: {think_said_as(exc, repr('none'))}", param="reasoning_effort"
        ) from None
    return _respond(path, choices, body, model, chat=True, plan=plan, prompt_ids=prompt_ids)


@router.post("/v1/completions", summary="Text completion from a raw prompt")
async def completions(
    body: CompletionRequest, path: Serving, x_request_id: str | None = _REQUEST_ID
) -> Response:
    model = path.state.model_for(body.model)
    if body.echo and body.logprobs is not None:
        raise UnsupportedParameter(
            "echo", "with logprobs (the prompt's log-probabilities are not computed)"
        )
    prompt = _prompt(body)
    if body.echo and not isinstance(prompt, str):
        raise UnsupportedParameter("echo", "with a prompt of token ids (text prompts only)")
    if body.suffix is not None:
        return await _fill_middle(body, path, model, prompt, x_request_id)
    text, tokens = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    requests = [
        GenerationRequest(
            prompt=text,
            prompt_tokens=tokens,
            sampling=_sampling_for(body, i),
            reuse_prefix=body.cache_prompt,
        )
        for i in range(body.n)
    ]
    prompt_ids = await _prompt_ids(model, body, requests[0])
    choices = await _submit(path, model, body, requests, x_request_id)
    echo = text if body.echo else None
    return _respond(path, choices, body, model, chat=False, echo=echo, prompt_ids=prompt_ids)


async def _fill_middle(
    body: CompletionRequest,
    path: RequestPath,
    model: Model,
    prompt: str | tuple[int, ...],
    request_id: str | None,
) -> Response:
    """``suffix`` given: the prompt is the text before the cursor, the suffix the text
    after it, and the completion is the middle, from the model's own FIM tokens."""
    if not isinstance(prompt, str):
        raise UnsupportedParameter("suffix", "with a prompt of token ids (text prompts only)")
    if body.echo:
        raise UnsupportedParameter("echo", "with a suffix (the middle comes alone)")
    # Claimed before the prompt is made: the stale completions end now.
    claim = path.claim(model, body.tokenbelt)
    infill = Infill(prefix=prompt, suffix=body.suffix or "")
    made = [
        await anyio.to_thread.run_sync(
            partial(
                model.infill_request,
                infill,
                _sampling_for(body, i),
                reuse_prefix=body.cache_prompt,
            )
        )
        for i in range(body.n)
    ]
    requests = [request for request, _ in made]
    prompt_ids = list(made[0][1].tokens) if body.return_token_ids else None
    choices = await _submit(path, model, body, requests, request_id, claim)
    return _respond(path, choices, body, model, chat=False, prompt_ids=prompt_ids)


router.include_router(_embeddings.router)
router.include_router(_audio.router)
