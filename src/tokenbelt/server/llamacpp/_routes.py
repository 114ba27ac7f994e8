"""llama.cpp's ``POST /infill``: code completion as llama.vim and llama.vscode send it.

The prompt is made from the model's own FIM tokens (``Model.infill_request``); each
candidate (``n_cmpl``) is a request of its own, decoded in the same batch. ``id_slot``
is the default supersede key: the next keystroke's completion ends this one
(``superseded``) even though these clients never abort a request. ``t_max_prompt_ms``
is the first-token deadline (enforced inside prefill, which llama.cpp leaves undone);
``t_max_predict_ms`` and ``n_indent`` end the completion at a line (``_rules.py``).
The answer is llama.cpp's shape, with tokenbelt's exact end reason and trace beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import anyio
from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from ...belt import EndReason
from ...engines import InfillPrompt, sampling_from
from ...runtime import Model, Stream
from ..core import (
    RELEASE_WAIT_S,
    Asgi,
    DeferredResponse,
    RequestPath,
    Serving,
    StreamEnd,
    UnsupportedParameter,
    error_response,
    failure,
    tokenbelt_final,
    until_end,
)
from ._rules import LineRules
from ._schemas import InfillRequest

API = "llamacpp"

router = APIRouter()


def _stop_type(reason: EndReason, rules: LineRules, stop_sequence: str | None) -> str:
    """llama.cpp's ``stop_type``: ``eos``, ``word`` (a stop string), ``limit`` (a
    length, a deadline, a line rule) or ``none`` (stopped from outside)."""
    if rules.stopped is not None or reason is EndReason.LENGTH or reason.is_timeout:
        return "limit"
    if reason is EndReason.STOP:
        return "word" if stop_sequence else "eos"
    return "none"


def _timings(stream: Stream) -> dict[str, Any]:
    t = stream.trace
    computed = max(0, t.prompt_tokens - t.cached_tokens)
    start = t.admitted if t.admitted is not None else t.enqueued
    prompt_ms = (t.first_token - start) * 1000 if t.first_token and start else 0.0
    predicted_ms = (t.last_token - t.first_token) * 1000 if t.last_token and t.first_token else 0.0

    def per(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0, n * 1000 / ms if ms > 0 else 0.0)

    p_tok, p_s = per(computed, prompt_ms)
    d_tok, d_s = per(t.completion_tokens, predicted_ms)
    return {
        "cache_n": t.cached_tokens,
        "prompt_n": computed,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(p_tok, 3),
        "prompt_per_second": round(p_s, 3),
        "predicted_n": t.completion_tokens,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(d_tok, 3),
        "predicted_per_second": round(d_s, 3),
    }


def _fields(answer: dict[str, Any], paths: list[str] | None) -> dict[str, Any]:
    """llama.cpp's ``response_fields``: only the given paths (``timings/prompt_n``), each
    under its path as the key; a path that is not there is left out."""
    if paths is None:
        return answer
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


class Candidate:
    """One candidate of a completion: its stream, its line rules and its answer."""

    def __init__(self, index: int, stream: Stream, body: InfillRequest) -> None:
        self.index = index
        self.stream = stream
        predict_s = body.t_max_predict_ms / 1000 if body.t_max_predict_ms > 0 else None
        self.rules = LineRules(body.n_indent, predict_s)
        self.warm_up = body.warm_up

    def feed(self, piece: str) -> bool:
        """Take a piece; True (and the request ended) when a line rule ends it here."""
        if self.warm_up or not self.rules.feed(piece):
            return False
        reason = EndReason.TOTAL_TIMEOUT if self.rules.stopped == "time" else EndReason.STOP
        self.stream.cancel(reason)
        return True

    def answer(
        self, body: InfillRequest, model: Model, prompt: InfillPrompt, streamed: bool
    ) -> dict[str, Any]:
        s, t = self.stream, self.stream.trace
        reason = s.end_reason or EndReason.RUNTIME_ERROR
        content = "" if self.warm_up or streamed else self.rules.text
        out: dict[str, Any] = {
            "index": self.index,
            "content": content,
            "tokens": [],
            "id_slot": body.id_slot,
            "stop": True,
            "model": model.name,
            "tokens_predicted": t.completion_tokens,
            "tokens_evaluated": t.prompt_tokens,
            "generation_settings": {
                "n_ctx": model.context_length,
                "n_predict": body.n_predict,
                "n_indent": body.n_indent,
                "t_max_prompt_ms": body.t_max_prompt_ms,
                "t_max_predict_ms": body.t_max_predict_ms,
                "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            },
            "has_new_line": self.rules.has_new_line,
            "truncated": prompt.truncated,
            "stop_type": _stop_type(reason, self.rules, t.stop_sequence),
            "stopping_word": t.stop_sequence or "",
            "tokens_cached": t.prompt_tokens + t.completion_tokens,
            "timings": _timings(s),
            "tokenbelt": tokenbelt_final(s),
        }
        if self.rules.stopped is not None:
            out["tokenbelt"]["line_rule"] = self.rules.stopped
        return _fields(out, body.response_fields)


@router.post("/infill", summary="llama.cpp: fill in the middle (code completion)")
async def infill(body: InfillRequest, path: Serving) -> Response:
    unknown = body.unknown_samplers()
    if unknown:
        raise UnsupportedParameter("samplers", f"no sampler named {', '.join(unknown)}")
    if body.stream and body.n_cmpl > 1:
        raise UnsupportedParameter("n_cmpl", "more than 1 with stream (one candidate a stream)")
    model = path.state.model_for(body.model)
    # Claimed first: the stale completions of this slot end before this one is tokenized.
    # A warm-up (n_predict 0) only fills the cache: it supersedes nothing by default.
    default = None if body.warm_up or body.id_slot < 0 else f"id_slot {body.id_slot}"
    options = body.options()
    claim = path.claim(model, options, default)
    sampling = sampling_from(body.sampling())
    make = partial(model.infill_request, body.infill(), sampling, reuse_prefix=body.cache_prompt)
    request, prompt = await anyio.to_thread.run_sync(make)
    candidates: list[Candidate] = []
    try:
        for i in range(body.n_cmpl):
            if i and body.seed is not None:
                seeded = dataclasses.replace(sampling, seed=(body.seed + i) % 2**32)
                request = dataclasses.replace(request, sampling=seeded)
            elif i:
                request = dataclasses.replace(request)  # a request of its own
            submitted = await path.submit(model, request, options, api=API, supersede=claim)
            candidates.append(Candidate(i, submitted.stream, body))
    except BaseException:
        for c in candidates:
            c.stream.cancel(EndReason.REJECTED)
        raise
    if body.stream:
        return _streamed(path, candidates[0], body, model, prompt)
    return _answered(candidates, body, model, prompt)


def _streamed(
    path: RequestPath, c: Candidate, body: InfillRequest, model: Model, prompt: InfillPrompt
) -> Response:
    """llama.cpp's stream: a ``data:`` object per piece, then the final one (its
    ``content`` empty: the text came in the pieces)."""
    s = c.stream

    async def pieces() -> AsyncIterator[object]:
        sent = 0
        async for piece in s:
            ended = c.feed(piece)
            if not c.warm_up:
                sent += 1
                yield {
                    "index": 0,
                    "content": piece,
                    "tokens": [],
                    "stop": False,
                    "id_slot": body.id_slot,
                    "tokens_predicted": sent,
                    "tokens_evaluated": s.trace.prompt_tokens,
                }
            if ended:
                return

    def end(how: StreamEnd) -> Iterator[object]:
        final = c.answer(body, model, prompt, streamed=True)
        if how.error is not None:
            final = {"error": {"code": 500, "message": how.error, "type": "server_error"}, **final}
        yield final

    return path.streaming(s, until_end(s, pieces(), end))


def _answered(
    candidates: list[Candidate], body: InfillRequest, model: Model, prompt: InfillPrompt
) -> Response:
    """One answer (a list of them with ``n_cmpl`` > 1), written once every candidate
    ended and was released; a client that goes away ends them ``client_disconnect``."""

    async def read(c: Candidate, errors: list[BaseException]) -> None:
        try:
            async for piece in c.stream:
                if c.feed(piece):
                    return
        except Exception as exc:
            errors.append(exc)

    async def compute() -> Any:
        errors: list[BaseException] = []
        async with anyio.create_task_group() as group:
            for c in candidates:
                group.start_soon(read, c, errors)
        for c in candidates:
            await c.stream.await_released(RELEASE_WAIT_S)
        head = {"x-request-id": candidates[0].stream.request_id}
        if errors:
            status, type_, code = failure(errors[0])
            return error_response(
                status, f"generation failed: {errors[0]}", type_, code, headers=head
            )
        answers = [c.answer(body, model, prompt, streamed=False) for c in candidates]
        return JSONResponse(answers if body.n_cmpl > 1 else answers[0], headers=head)

    def stop() -> None:
        for c in candidates:
            c.stream.cancel(EndReason.CLIENT_DISCONNECT)

    return Asgi(DeferredResponse(stop, compute))
