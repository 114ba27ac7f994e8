"""The request path every API shares: submit, stream or answer, and the end of a request.

The OpenAI, Ollama and Anthropic routes only translate bodies; admission, deadlines,
belt capacity, the request record, metrics and the race against the client's
disconnect all happen here, the same way for each of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal

import anyio
from fastapi import Depends, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..._errors import RuntimeClosed
from ...belt import EndReason, new_request_id
from ...engines import GenerationRequest
from ...runtime import Claim, EmbeddingStream, Model, ModelState, Stream, TranscriptionStream
from ._errors import NO_RETRY, ErrorShape, compact_json, error_response, failure
from ._fit import Fit, fit_messages
from ._middleware import CALLER, REQUEST_ID, SUPERSEDE
from ._options import TokenbeltOptions
from ._responses import (
    SSE_KEEPALIVE,
    DeferredResponse,
    Encode,
    EventStreamResponse,
    disconnect,
    reader_gone,
    sse,
)
from ._state import ServerState

#: how long an answer waits for the engine to let go before it is written anyway
RELEASE_WAIT_S = 2.0


class Asgi(Response):
    """Lets a route return one of our ASGI callables as a starlette ``Response``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Any]) -> None:
        self.app = app
        self.background = None
        self.status_code = 200
        self.raw_headers = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


#: a request of any kind, once it ended: its end reason and trace are what is read
Ended = Stream | EmbeddingStream | TranscriptionStream


def tokenbelt_final(stream: Ended) -> dict[str, Any]:
    """The ``tokenbelt`` object of a finished request: its exact end reason and trace,
    and for a thinking model the phase it ended in (``ended_in``; ``answer_started``
    false, with a ``note``, when its end came before any answer)."""
    reason = stream.end_reason or EndReason.RUNTIME_ERROR
    final: dict[str, Any] = {"end_reason": reason.value, "trace": stream.trace.to_dict()}
    phase = stream.trace.phase
    if phase is not None:
        final["ended_in"] = phase
        final["answer_started"] = phase == "answer"
        if phase == "reasoning":
            final["note"] = (
                f"the answer never started: the request ended ({reason.value}) inside "
                f"the reasoning phase, after {stream.trace.reasoning_tokens} reasoning tokens"
            )
            if reason is EndReason.LENGTH or reason.value.endswith("_timeout"):
                final["note"] += (
                    "; raise the limit or bound the reasoning (tokenbelt.reasoning_budget, "
                    "tokenbelt.reasoning_timeout) so the answer starts in time"
                )
    return final


def end_failure(
    ended: Ended,
    head: dict[str, str],
    status: int,
    message: str,
    type_: str,
    code: str,
    *,
    retry: bool,
    shape: ErrorShape,
) -> Response:
    """A non-streamed answer's error for ``ended``, in the API's ``shape``, with its exact
    end reason and trace beside it; ``retry=False`` adds ``x-should-retry: false`` (a
    retry would repeat work the server stopped)."""
    return error_response(
        status,
        message,
        type_,
        code,
        headers=head if retry else {**head, **NO_RETRY},
        extra={"tokenbelt": tokenbelt_final(ended)},
        shape=shape,
    )


def with_reasoning(
    request: GenerationRequest,
    options: TokenbeltOptions | None,
    state: ServerState,
    thinks: bool,
) -> GenerationRequest:
    """``request`` with tokenbelt's own reasoning bounds: the request's ``tokenbelt``
    fields first, then the dialect's own (already in its sampling), then the server's
    (for a model that ``thinks``: a default is no demand on one that does not)."""
    s = request.sampling
    budget = options.reasoning_budget if options is not None else None
    timeout = options.reasoning_timeout if options is not None else None
    budget = budget if budget is not None else s.reasoning_budget
    timeout = timeout if timeout is not None else s.reasoning_timeout
    settings = state.settings
    if thinks:
        budget = budget if budget is not None else settings.reasoning_budget
        timeout = timeout if timeout is not None else settings.reasoning_timeout
    if (budget, timeout) == (s.reasoning_budget, s.reasoning_timeout):
        return request
    sampling = dataclasses.replace(s, reasoning_budget=budget, reasoning_timeout=timeout)
    return dataclasses.replace(request, sampling=sampling)


@dataclass(frozen=True)
class StreamEnd:
    """How a stream ended, for its dialect's terminal events: the exact reason, and the
    engine's failure when it failed (an engine error, a worker crash)."""

    reason: EndReason
    failed: Exception | None = None

    @property
    def error(self) -> str | None:
        """The failure as one line (``generation failed: WorkerCrashed: ...``), or None."""
        if self.failed is None:
            return None
        return f"generation failed: {type(self.failed).__name__}: {self.failed}"


async def until_end(
    stream: Stream,
    events: AsyncIterator[object],
    end: Callable[[StreamEnd], Iterable[object]],
) -> AsyncIterator[object]:
    """A dialect's streamed body that always ends with its own terminal events.

    Yields ``events`` (the dialect's events for the pieces of ``stream``); then, however
    the stream ended (naturally, a stop, a deadline, the engine's failure, a worker
    crash), waits for the engine to let go (at most ``RELEASE_WAIT_S``, so the trace
    holds the release) and yields ``end(how)``: Ollama's ``done`` line, Anthropic's
    ``message_delta`` and ``message_stop``, the Responses API's terminal event. A
    failure raised while reading is given to ``end``, never raised into the writer.
    """
    failed: Exception | None = None
    try:
        async for event in events:
            yield event
    except Exception as exc:  # the engine failed: the dialect says so, then ends
        failed = exc
    finally:
        # Closed early (the client went away): the dialect's generator ends now too.
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
    await stream.await_released(RELEASE_WAIT_S)
    for event in end(StreamEnd(stream.end_reason or EndReason.RUNTIME_ERROR, failed)):
        yield event


class Submitted:
    """A request on its way: its stream and how long loading the model took for it."""

    def __init__(self, stream: Stream, load_s: float) -> None:
        self.stream = stream
        #: seconds spent loading the model again (it had been unloaded for being idle)
        self.load_s = load_s


class RequestPath:
    """Submits requests for every API and writes their answers."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def submit(
        self,
        model: Model,
        request: GenerationRequest,
        options: TokenbeltOptions | None,
        *,
        api: str,
        request_id: str | None = None,
        keep_alive: float | Literal["default"] | None = "default",
        fit: Fit | None = None,
        supersede: str | Claim | None = None,
    ) -> Submitted:
        """Queue ``request`` with the deadlines and capacity of ``options``.

        Blocks (off the event loop) only to reload a model unloaded for being idle and
        to count the prompt's tokens. Admission errors propagate to the error handlers.
        ``request_id`` is the caller's own (``x-request-id``), used if well-formed and new.
        ``keep_alive`` is this request's own (``Model.submit``); it changes no default.
        ``fit``: a chat's oldest turns are left out until its prompt fits the window
        with room for the reply (``fit_messages``; the trace counts them).
        ``supersede``: the route's own key or claim (``/infill``'s ``id_slot``), used when
        neither ``options.supersede`` nor the ``X-Tokenbelt-Supersede`` header gives one.
        """
        if self.state.shutting_down:
            raise RuntimeClosed("the server is shutting down")
        # Every API's request goes by the id its answer carries (``RequestIdMiddleware``).
        request_id = request_id or REQUEST_ID.get()
        request_id = self.state.request_id_from(request_id) or new_request_id()
        self.state.own(request_id, CALLER.get())
        self.state.metrics.label(request_id, api)
        request = with_reasoning(request, options, self.state, model.thinks)
        if options is not None and options.draft is not None:
            request = dataclasses.replace(request, draft=options.draft)
        reloading = model.state is not ModelState.READY
        started = time.monotonic()
        claim = self.claim(model, options, supersede)

        def queue(request: GenerationRequest, **how: Any) -> Stream:
            # Fitted and queued on one worker thread: both tokenize, neither on the loop.
            dropped = 0
            if fit is not None:
                request, dropped = fit_messages(model, request, fit)
            return model.submit(request, dropped_messages=dropped, **how)

        try:
            stream = await anyio.to_thread.run_sync(
                partial(
                    queue,
                    request,
                    limits=self.state.limits_for(options, model),
                    capacity=self.state.capacity_for(options),
                    request_id=request_id,
                    keep_alive=keep_alive,
                    supersede=claim,
                )
            )
        except BaseException:
            self.state.metrics.forget(request_id)
            self.state.disown(request_id)
            raise
        load_s = float(model.info.get("load_s", 0.0)) if reloading else 0.0
        self.state.track(stream)
        return Submitted(stream, min(load_s, time.monotonic() - started))

    @staticmethod
    def claim(
        model: Model, options: TokenbeltOptions | None, default: str | Claim | None = None
    ) -> Claim | None:
        """The supersede claim of a request: on ``tokenbelt.supersede``, else the
        ``X-Tokenbelt-Supersede`` header, else ``default`` (a route's own key); a key is
        the caller's own (two API keys never supersede each other). Claiming ends the
        key's earlier requests at once, before this one is even tokenized."""
        if isinstance(default, Claim):
            return default
        key = (options.supersede if options is not None else None) or SUPERSEDE.get() or default
        if key is None:
            return None
        caller = CALLER.get()
        return model.claim(f"{caller.identity}:{key}" if caller is not None else key)

    def streaming(
        self,
        stream: Stream,
        events: AsyncIterator[object],
        *,
        headers: dict[str, str] | None = None,
        encode: Encode = sse,
        media_type: str = "text/event-stream; charset=utf-8",
        also: Sequence[Stream] = (),
        keepalive: bytes | None = SSE_KEEPALIVE,
    ) -> Response:
        """A streamed body; a client that goes away ends the request ``client_disconnect``
        (and the requests of the other choices, ``also``, when it asked for several).

        A client whose socket takes nothing for the server's reader timeout ends it
        ``reader_timeout`` (and its connection is closed). While no event comes for the
        server's ``keepalive_s``, ``keepalive`` is written (None: nothing, as for NDJSON).
        """
        head = {"x-request-id": stream.request_id, **(headers or {})}
        streams = [stream, *also]
        every = self.state.settings.keepalive_s
        return Asgi(
            EventStreamResponse(
                _stop_all(streams, disconnect),
                events,
                head,
                encode=encode,
                media_type=media_type,
                reader_timeout=self.state.settings.reader_timeout,
                gone=_stop_all(streams, reader_gone),
                keepalive=(every, keepalive) if keepalive and every else None,
            )
        )

    @staticmethod
    def answer(
        stream: Stream,
        render: Callable[[Stream], dict[str, Any]],
        *,
        shape: ErrorShape,
        headers: dict[str, str] | None = None,
        also: Sequence[Stream] = (),
    ) -> Response:
        """A non-streaming answer, written once the engine has let go of the request
        (and of the other choices' requests, ``also``, all read at the same time).

        The end decides the status: 500 for an engine failure (an upstream's 4xx passes
        through, any other upstream failure is 502), 504 for a deadline, 503
        for a shutdown (each in the API's error ``shape``, with the exact end reason and
        trace beside it; the last two with ``x-should-retry: false``, since a retry would
        repeat work the server stopped); any other end is ``render(stream)`` with 200.
        """
        head = {"x-request-id": stream.request_id, **(headers or {})}

        def failed(
            ended: Stream, status: int, message: str, type_: str, code: str, retry: bool = True
        ) -> Response:
            return end_failure(ended, head, status, message, type_, code, retry=retry, shape=shape)

        streams = [stream, *also]

        async def read(i: int, errors: list[Exception | None]) -> None:
            try:
                await streams[i].aread()
            except Exception as exc:
                errors[i] = exc

        async def compute() -> Response:
            errors: list[Exception | None] = [None] * len(streams)
            if also:
                async with anyio.create_task_group() as group:
                    for i in range(len(streams)):
                        group.start_soon(read, i, errors)
            else:
                await read(0, errors)
            for s in streams:
                await s.await_released(RELEASE_WAIT_S)
            head["x-tokenbelt-trace"] = compact_json(stream.trace.to_dict())
            for s, exc in zip(streams, errors, strict=True):
                if exc is not None:
                    status, type_, code = failure(exc)
                    return failed(s, status, f"generation failed: {exc}", type_, code)
            for s in streams:
                reason = s.end_reason or EndReason.RUNTIME_ERROR
                if reason.is_timeout:
                    message = f"the request ended with {reason.value}"
                    return failed(s, 504, message, "timeout", reason.value, retry=False)
                if reason is EndReason.SHUTDOWN:
                    message = "the server is shutting down"
                    return failed(s, 503, message, "service_unavailable", "shutdown", retry=False)
            return JSONResponse(render(stream), headers=head)

        later: Callable[[], Awaitable[Callable[[Scope, Receive, Send], Awaitable[None]]]] = compute
        return Asgi(DeferredResponse(_stop_all(streams, disconnect), later))


async def serving(request: Request) -> RequestPath:
    """The serving core of the app a request came to (a route's dependency)."""
    path: RequestPath = request.app.state.tokenbelt_path
    return path


#: what a route declares to be given the serving core: ``path: Serving``
Serving = Annotated[RequestPath, Depends(serving)]


def _stop_all(
    streams: Sequence[Stream], how: Callable[[Stream], Callable[[], object]]
) -> Callable[[], None]:
    """One stop for every choice of an answer: ``how`` makes each stream's own."""
    stops = [how(s) for s in streams]

    def stop() -> None:
        for each in stops:
            each()

    return stop
