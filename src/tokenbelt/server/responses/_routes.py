"""The Responses dialect: ``/v1/responses`` and the routes of one response.

``POST /v1/responses`` translates the body into the same chat request the chat route
makes (``openai._tools.plan``: the same prompt, grammar and call parsing), submits it
through the serving core, and answers with a ``Turn``'s events or its final object.
A ``background`` response is read by a task of its own into the store; with
``stream`` too, the answer follows its stored events from the first, as a later
``GET ?stream=true`` does (a reader that leaves stops nothing: it may come back with
``starting_after``). Every response in flight can be cancelled by id, whoever is (or
is not) reading it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request
from starlette.responses import JSONResponse, Response

from ..._defaults import DEFAULT_MAX_TOKENS
from ..._errors import InvalidArgument, PromptTooLong
from ...belt import EndReason
from ...engines import GenerationRequest, Piece, SamplingParams
from ...runtime import Model, Stream, sampling_from
from ..core import (
    CALLER,
    RELEASE_WAIT_S,
    Asgi,
    EventStreamResponse,
    Fit,
    NotHere,
    RequestPath,
    Serving,
    UnsupportedParameter,
    named_sse,
    openai_shape,
    think_said_as,
    until_end,
)
from ..openai import _tools
from . import _items
from ._schemas import ResponseRequest
from ._store import UNKNOWN, Entry, Gone, Responses, Running
from ._tools import Offered, offered
from ._turn import Turn

API = "responses"
router = APIRouter()
# The header is the parameter's own name (x_request_id -> x-request-id): an alias here made
# pydantic warn, in the request that first built the route, that it has no effect.
_REQUEST_ID = Header(
    None,
    description="use this request id (letters, digits, ._:-, at most 64) if it is new",
)
#: what ``include`` may ask for: nothing this server makes (it has no reasoning items)
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})


def responses_of(request: Request) -> Responses:
    """The Responses memory of the app a request came to (a route's dependency)."""
    found: Responses = request.app.state.tokenbelt_responses
    return found


Memory = Annotated[Responses, Depends(responses_of)]


def typed_sse(event: object) -> bytes:
    """A Responses event, named by its ``type`` as OpenAI sends them."""
    assert isinstance(event, dict)
    return named_sse(event["type"], event)


# -- the request ---------------------------------------------------------------------------


def _keep(body: ResponseRequest, memory: Responses) -> bool:
    """Whether the response is stored: ``store``'s value, by default whether a store exists."""
    enabled = memory.store.enabled
    if body.store and not enabled:
        raise UnsupportedParameter(
            "store", "this server keeps no responses (start it with --responses-store SIZE)"
        )
    if body.background and not enabled:
        raise UnsupportedParameter(
            "background",
            "a background response is kept in the response store, which is off "
            "(start the server with --responses-store SIZE)",
        )
    if body.background and body.store is False:
        raise UnsupportedParameter("background", "needs store: a background response is kept")
    if body.previous_response_id is not None and not enabled:
        raise UnsupportedParameter(
            "previous_response_id",
            "this server is stateless: it keeps no responses, so it cannot continue one "
            "(send the whole conversation as input, or start it with --responses-store SIZE)",
        )
    return enabled if body.store is None else body.store


def _plan(
    body: ResponseRequest, messages: list[dict[str, Any]], model: Model, offered: Offered
) -> _tools.Plan:
    """The chat plan of the request, with the functions its tools offer."""
    tools = offered.specs
    choice: _tools.ToolChoice | None
    if isinstance(body.tool_choice, str) or body.tool_choice is None:
        choice = body.tool_choice
    else:
        named = _tools.NamedFunction(name=body.tool_choice.name)
        choice = _tools.NamedToolChoice(type="function", function=named)
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        spec = None
        if fmt.type == "json_schema":
            if fmt.name is None:
                raise UnsupportedParameter("text.format.name", "a json_schema format needs a name")
            spec = _tools.JsonSchemaFormat(
                name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict
            )
        response_format = _tools.ResponseFormat(type=fmt.type, json_schema=spec)
    return _tools.plan(
        messages, response_format, tools or None, choice, model.template_tools, model.tool_format
    )


#: what a response says of options tokenbelt has one value for: no log probabilities
#: here, one call at most per reply, one service tier
CONSTANTS = {"top_logprobs": 0, "max_tool_calls": 1, "service_tier": "default"}


def _echo(body: ResponseRequest, keep: bool, sampling: SamplingParams) -> dict[str, Any]:
    """What a response object repeats of its request: every field of the Open
    Responses object, the sampling as the numbers used (the defaults filled in)."""
    fmt = body.text.format if body.text and body.text.format else None
    tool_choice: Any = body.tool_choice if body.tool_choice is not None else "auto"
    if not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        **CONSTANTS,
        "safety_identifier": body.safety_identifier,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {
            "format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}
        },
        "metadata": body.metadata or {},
        "store": keep,
        "background": body.background,
        "previous_response_id": body.previous_response_id,
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "prompt_cache_key": body.prompt_cache_key,
        "reasoning": {"effort": body.reasoning.effort, "summary": None}
        if body.reasoning is not None
        else None,
    }


def _request(body: ResponseRequest, plan: _tools.Plan) -> GenerationRequest:
    stop = body.stop
    sampling = sampling_from(
        {
            "max_tokens": body.max_output_tokens or DEFAULT_MAX_TOKENS,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "seed": body.seed,
            "stop": [stop] if isinstance(stop, str) else stop,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "think": body.reasoning.think() if body.reasoning is not None else None,
        }
    )
    return GenerationRequest(
        messages=plan.messages, sampling=sampling, grammar=plan.grammar, tools=plan.tools_json
    )


async def _fits(model: Model, request: GenerationRequest) -> bool:
    """Whether ``request``'s prompt leaves room for a token in ``model``'s context (a
    tokenization off the event loop; an error is left to the submit that follows)."""
    try:
        tokens = await anyio.to_thread.run_sync(model.count_prompt_tokens, request)
    except PromptTooLong:
        return False
    except InvalidArgument:
        return True
    return tokens < model.context_length


# -- making a response ---------------------------------------------------------------------


class _Making:
    """One response being made: its turn, the chat deltas it is fed, where it is kept."""

    def __init__(
        self, memory: Responses, turn: Turn, stream: Stream, plan: _tools.Plan, keep: Entry | None
    ) -> None:
        self.memory = memory
        self.turn = turn
        self.stream = stream
        self.plan = plan
        self.deltas = _tools.Deltas(plan)
        self.keep = keep

    def feed(self, piece: str) -> list[dict[str, Any]]:
        events = []
        if isinstance(piece, Piece) and piece.reasoning:
            events = self.turn.reasoning(piece.reasoning)
            if not piece:
                return events
        return events + [e for delta in self.deltas.feed(piece) for e in self.turn.feed(delta)]

    def finish(self, failed: Exception | None) -> list[dict[str, Any]]:
        early = self.stream.end_reason is not EndReason.STOP
        events = [e for delta in self.deltas.finish(early) for e in self.turn.feed(delta)]
        # its grammar, its schema check, a cut call, as on /v1/chat/completions
        self.turn.extension.update(self.plan.extension())
        events += self.turn.finish(self.stream, bool(self.plan.calls) and not self.plan.cut, failed)
        if self.keep is not None:
            store = self.memory.store
            if self.keep.running:
                store.finish(self.turn.id, self.turn.snapshot())
            else:
                self.keep.response = self.turn.snapshot()
                store.put(self.turn.id, self.keep)
        return events

    def done(self) -> None:
        self.memory.running.pop(self.turn.id, None)

    def finish_whole(self) -> None:
        """A blocking response's end: what the stream made, fed at once, then its end."""
        self.feed(Piece(self.stream.text, (), self.stream.reasoning))
        self.finish(None)

    def keep_unfinished(self, *, fed: bool = True) -> None:
        """A response whose reader left before its end (a disconnect, a reader timeout):
        kept as it stood, with the stream's end reason (``cancelled``), so a conversation
        goes on from it. ``fed``: False for a blocking response, whose text is fed only
        at its end."""
        if self.keep is None or self.turn.finished.is_set():
            return
        if fed:
            self.finish(None)
        else:
            self.finish_whole()

    async def events(self) -> Any:
        """Every event of the response, the terminal one last, however it ends."""

        async def pieces() -> AsyncIterator[object]:
            for event in self.turn.start():
                yield event
            async for piece in self.stream:
                for event in self.feed(piece):
                    yield event

        try:
            async for event in until_end(
                self.stream, pieces(), lambda how: self.finish(how.failed)
            ):
                yield event
        finally:
            self.keep_unfinished()
            self.done()

    async def background(self) -> None:
        """Read the response into the store, with no reader (its budget is its bound)."""
        try:
            async for event in self.events():
                await self.memory.store.append(self.turn.id, event)
        finally:
            self.stream.cancel(EndReason.USER_CANCEL)  # no-op once it ended


def _cleanup_after(app: Asgi, making: _Making) -> Asgi:
    inner = app.app

    async def run(scope: Any, receive: Any, send: Any) -> None:
        try:
            await inner(scope, receive, send)
        finally:
            making.keep_unfinished(fed=False)
            making.done()

    return Asgi(run)


@router.post("/v1/responses", summary="Create a response (streaming with stream=true)")
async def create(
    body: ResponseRequest,
    path: Serving,
    memory: Memory,
    x_request_id: str | None = _REQUEST_ID,
) -> Response:
    model = path.state.model_for(body.model)
    keep = _keep(body, memory)
    for i, name in enumerate(body.include or ()):
        if name not in _INCLUDABLE:
            raise UnsupportedParameter(f"include.{i}", f"{name!r} is not something tokenbelt makes")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        try:
            history = memory.store.conversation(body.previous_response_id)
        except Gone as exc:
            raise _not_here(memory, exc, param="previous_response_id") from exc
    items = _items.items_from(body.input)
    _items.match_outputs([*history, *items], first=len(history))
    messages = _items.messages_from([*history, *items], model.name)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    settings = path.state.settings
    tools = offered(
        body.tools or (), settings.responses_builtin_tools, settings.responses_skip_tools
    )
    plan = _plan(body, messages, model, tools)
    request = _request(body, plan)
    if tools.namespaces and not await _fits(model, request):
        tools = tools.without_namespaces()
        plan = _plan(body, messages, model, tools)
        request = _request(body, plan)
    try:
        submitted = await path.submit(
            model,
            request,
            body.tokenbelt,
            api=API,
            request_id=x_request_id,
            fit=Fit(model.context_length, "truncation", required=True)
            if body.truncation == "auto"
            else None,
        )
    except InvalidArgument as exc:
        if exc.param != "think":
            raise
        # The engine names its own parameter; this body said it as reasoning.effort.
        raise UnsupportedParameter("reasoning.effort", think_said_as(exc, "'none'")) from None
    stream = submitted.stream
    echo = _echo(body, keep, request.sampling)
    turn = Turn(
        "resp_" + stream.request_id.removeprefix("req_"), model.name, echo, tools.namespaces
    )
    tools.say_skipped(stream.request_id, model.context_length)
    turn.extension.update(tools.said())
    entry: Entry | None = None
    if keep:
        entry = Entry(turn.snapshot(), items, body.previous_response_id, stream.request_id)
    making = _Making(memory, turn, stream, plan, entry)
    running = Running(turn, stream)
    memory.running[turn.id] = running
    if body.background:
        assert entry is not None
        entry.running, entry.events = True, []
        memory.store.put(turn.id, entry)
        running.task = asyncio.get_running_loop().create_task(making.background())
        if body.stream:
            return _replay(path, entry, None)
        return JSONResponse(turn.snapshot(), headers={"x-request-id": stream.request_id})
    if body.stream:
        response = path.streaming(stream, making.events(), encode=typed_sse)
        assert isinstance(response, Asgi)
        return response

    def render(s: Stream) -> dict[str, Any]:
        making.finish_whole()
        return turn.snapshot()

    answer = path.answer(stream, render, shape=openai_shape)
    assert isinstance(answer, Asgi)
    return _cleanup_after(answer, making)


# -- one response --------------------------------------------------------------------------


def _not_here(memory: Responses, exc: Gone, param: str = "response_id") -> NotHere:
    """The 404 for a response that is not here (``response_not_found``)."""
    text = str(exc)
    if not memory.store.enabled:
        text = (
            f"no response {exc.response_id!r}: it is not in progress, and this server keeps "
            "no responses (start it with --responses-store SIZE to keep them)"
        )
    return NotHere(text, code="response_not_found", param=param)


def _visible(path: RequestPath, request_id: str) -> bool:
    """With API keys, a response made with another key answers as an unknown one."""
    return path.state.visible_to(request_id, CALLER.get())


def _running(memory: Responses, path: RequestPath, response_id: str) -> Running | None:
    found = memory.running.get(response_id)
    return found if found is not None and _visible(path, found.stream.request_id) else None


def _entry(memory: Responses, path: RequestPath, response_id: str) -> Entry:
    entry = memory.store.get(response_id)
    if not _visible(path, entry.request_id):
        raise Gone(response_id, UNKNOWN)
    return entry


@router.get("/v1/responses/{response_id}", summary="A response in progress or stored")
async def retrieve(
    response_id: str,
    path: Serving,
    memory: Memory,
    stream: bool = Query(False, description="replay a background response's events"),
    starting_after: int | None = Query(None, ge=-1),
) -> Response:
    try:
        if stream:
            return _replay(path, _entry(memory, path, response_id), starting_after)
        running = _running(memory, path, response_id)
        if running is not None:
            return JSONResponse(running.turn.snapshot())
        return JSONResponse(_entry(memory, path, response_id).response)
    except Gone as exc:
        raise _not_here(memory, exc) from exc


def _replay(path: RequestPath, entry: Entry, starting_after: int | None) -> Response:
    if entry.events is None:
        raise InvalidArgument(
            "only a background response's events are kept: this one was not background",
            param="stream",
        )
    after = -1 if starting_after is None else starting_after

    async def events() -> Any:
        sent = after + 1
        while True:
            grew = entry.grew
            assert entry.events is not None
            while sent < len(entry.events):
                yield entry.events[sent]
                sent += 1
            if not entry.running:
                return
            await grew.wait()

    head = {"x-request-id": entry.request_id}
    return Asgi(
        EventStreamResponse(
            lambda: None,
            events(),
            head,
            encode=typed_sse,
            reader_timeout=path.state.settings.reader_timeout,
        )
    )


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response")
async def delete(response_id: str, path: Serving, memory: Memory) -> Response:
    running = _running(memory, path, response_id)
    if running is not None:
        await _stop(running)
    try:
        _entry(memory, path, response_id)
        memory.store.delete(response_id)
    except Gone as exc:
        raise _not_here(memory, exc) from exc
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def _stop(running: Running) -> None:
    running.stream.cancel(EndReason.USER_CANCEL)
    await running.stream.await_released(RELEASE_WAIT_S)
    with anyio.move_on_after(RELEASE_WAIT_S):
        await running.turn.finished.wait()


@router.post(
    "/v1/responses/{response_id}/cancel",
    summary="Stop a response in progress, streamed, blocking or background (user_cancel)",
)
async def cancel(response_id: str, path: Serving, memory: Memory) -> Response:
    running = _running(memory, path, response_id)
    if running is not None:
        await _stop(running)
        return JSONResponse(running.turn.snapshot())
    try:
        return JSONResponse(_entry(memory, path, response_id).response)
    except Gone as exc:
        raise _not_here(memory, exc) from exc


@router.get("/v1/responses/{response_id}/input_items", summary="A stored response's input")
async def input_items(
    response_id: str,
    path: Serving,
    memory: Memory,
    order: str = Query("desc", pattern="^(asc|desc)$"),
    limit: int = Query(20, ge=1, le=100),
    after: str | None = Query(None),
) -> Response:
    try:
        entry = _entry(memory, path, response_id)
    except Gone as exc:
        raise _not_here(memory, exc) from exc
    items = list(entry.items if order == "asc" else reversed(entry.items))
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidArgument(f"no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
