"""Chat: the chat surface of ``Model`` (``ChatCalls``: a request submitted, its prompt's
tokens, one-off streams) and sessions (``ChatSession``), a conversation kept across
turns, with sync and async sending."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import IllegalState, InvalidArgument
from ..belt import Belt, Limits
from ..engines import Engine, GenerationRequest, Message, Tokenizes, sampling_from
from ._keepalive import RequestKeepAlive
from ._stream import Reply, Stream
from ._structured import Structure, render_messages, structure, tools_json
from ._supersede import Claim
from ._surface import EngineCalls

if TYPE_CHECKING:
    from ._model import Model

#: what a model of a catalog ``kind`` other than chat is, and what it serves instead
_NOT_CHAT = {
    "embedding": ("an embedding model", "embeddings"),
    "rerank": ("a reranker", "rerank"),
    "speech": ("a speech model", "transcribe, or /v1/audio/transcriptions"),
}

_T = TypeVar("_T")


class ChatCalls(EngineCalls):
    """The chat surface of ``Model``: ``submit`` (a chat model's generation requests),
    the prompt's tokens and their count, and one-off streams (``stream``, ``complete``).
    It stands on what the template renders and, as ``EmbeddingCalls`` does, on the two
    ways the model uses its loaded engine: ``_on_engine`` (use it now, queueing nothing)
    and ``_queue`` (queue a request through the admission queue)."""

    info: dict[str, Any]

    @property
    def tool_format(self) -> str:
        raise NotImplementedError

    @property
    def template_tools(self) -> bool:
        raise NotImplementedError

    def keep_alive_for_request(self, keep_alive: RequestKeepAlive) -> None:
        raise NotImplementedError

    def claim(self, key: str) -> Claim:
        raise NotImplementedError

    def submit(
        self,
        request: GenerationRequest,
        *,
        limits: Limits | None = None,
        capacity: int | None = None,
        request_id: str | None = None,
        on_complete: Callable[[Stream], None] | None = None,
        structure: Structure | None = None,
        keep_alive: RequestKeepAlive = "default",
        dropped_messages: int = 0,
        supersede: str | Claim | None = None,
    ) -> Stream:
        """Queue ``request`` and return its ``Stream`` at once.

        ``keep_alive`` is this request's own: the seconds the model stays loaded once
        idle after it (``None``: for ever; ``0``: unloaded then), unless a later request
        brings its own; ``"default"`` is the model's ``keep_alive``. ``dropped_messages``:
        how many of a chat's oldest messages the caller left out so that it fits the
        context window (its trace says so). ``supersede``: a key (or a ``Claim`` on one,
        ``claim(key)``, for several requests of one completion): the earlier requests
        with that key, queued or running, end ``superseded`` before this one queues.

        Blocks only while the model is reloaded after an idle unload (by this call or
        another's; waiting at most the request's first-token or total limit, then
        ``ModelLoading``). Raises ``PromptTooLong`` (before queueing), ``QueueFull`` when the
        admission queue is full (the trace ends ``rejected``), ``RuntimeClosed``.
        Deadlines in ``limits`` count from now (enqueue). A model whose catalog entry
        says it is an ``embedding`` or ``rerank`` model refuses (``InvalidArgument``).
        """
        kind = self.info.get("kind", "chat")
        if kind != "chat":
            what, use = _NOT_CHAT.get(kind, ("a reranker", "rerank"))
            raise InvalidArgument(
                f"model {self.name} is {what}: it does not generate text (use {use})",
                param="model",
            )
        self.keep_alive_for_request(keep_alive)
        claim = self.claim(supersede) if isinstance(supersede, str) else supersede

        def open_stream(queued: GenerationRequest, belt: Belt[Any]) -> Stream:
            belt.trace.dropped_messages = dropped_messages
            belt.trace.infill = queued.infill
            if claim is not None:
                claim.add(belt)
            return Stream(belt, on_complete=on_complete, structure=structure)

        return self._queue(
            lambda engine: (request, engine.count_prompt_tokens(request)),
            open_stream,
            limits,
            capacity,
            request_id,
        )

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt tokens ``request`` would have if it were submitted now (its trace's
        ``prompt_tokens``): the chat template and the tools included; nothing is queued.

        Blocks to tokenize, and to reload a model unloaded for being idle (the
        keep-alive counts again from here). Raises as ``submit`` does before queueing
        (``PromptTooLong``, ``InvalidArgument``, ``ModelLoading``, ``RuntimeClosed``).
        """
        return self._on_engine(lambda engine: engine.count_prompt_tokens(request))

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids as the engine will see them (the chat template and the
        tools included); nothing is queued. Blocks and raises as ``count_prompt_tokens``,
        and ``InvalidArgument`` for an engine that has no vocabulary here (remote)."""
        tokens = self.prompt_token_ids_here(request)
        if tokens is None:
            raise InvalidArgument(
                f"return_token_ids is not supported by the {self.name} engine",
                param="return_token_ids",
            )
        return tokens

    def prompt_token_ids_here(
        self, request: GenerationRequest, *, keep: bool = False
    ) -> list[int] | None:
        """As ``prompt_token_ids``, or None where the engine has no vocabulary here (a
        remote engine: its upstream tokenizes). With ``keep``, the engine keeps them for
        ``request``: submitted next, it is not tokenized again."""

        def token_ids(engine: Engine) -> list[int] | None:
            if not isinstance(engine, Tokenizes):
                return None
            tokens = list(engine.tokenize_request(request))
            if keep:
                engine.remember_prompt_tokens(request, tokens)
            return tokens

        return self._on_engine(token_ids)

    def stream(
        self,
        messages: Sequence[Message] | str | None = None,
        *,
        prompt: str | None = None,
        limits: Limits | None = None,
        capacity: int | None = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        draft: str | None = None,
        **sampling: Any,
    ) -> Stream:
        """Stream a reply to chat ``messages`` (or a raw ``prompt``) without a session.

        ``messages`` may be one string: a single user message. ``schema`` (a pydantic
        model class or a JSON schema dict) constrains the reply to that schema; ``tools``
        (OpenAI-shaped functions) and ``tool_choice`` let it call one (``messages`` may
        then hold ``tool_calls`` and ``tool`` turns). The reply's ``parsed`` and
        ``tool_calls`` hold the result. ``draft`` (``lookup``/``off``; None: the
        runtime's) turns prompt-lookup drafting on or off for this request.
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        shape = structure(schema, tools, tool_choice, self.tool_format)
        tools_text = None
        if shape is not None and shape.tools and messages is not None:
            own = self.template_tools
            messages = render_messages(messages, shape.tools, shape.choice, own)
            tools_text = tools_json(shape.tools, shape.choice, own)
        request = GenerationRequest(
            messages=None if messages is None else tuple(messages),
            prompt=prompt,
            sampling=sampling_from(sampling),
            grammar=shape.grammar if shape else None,
            tools=tools_text,
            draft=draft,
        )
        return self.submit(request, limits=limits, capacity=capacity, structure=shape)

    def complete(self, messages: Sequence[Message] | str | None = None, **kwargs: Any) -> Reply:
        """Blocking ``stream(...).read()``."""
        return self.stream(messages, **kwargs).read()


class ChatSession:
    """A conversation with one model.

    A turn joins the history only when it ends naturally (``stop`` or
    ``length``) and was read to the end; a cancelled, timed-out or failed turn
    leaves the history as it was. One turn runs at a time. Keyword arguments
    given here are default sampling parameters for every turn.
    """

    def __init__(self, model: Model, *, system: str | None = None, **defaults: Any) -> None:
        self.model = model
        self.conversation_id = "conv_" + secrets.token_hex(8)
        self.messages: list[Message] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self._defaults = sampling_from(defaults)
        self._lock = threading.Lock()
        self._active: Stream | None = None

    @property
    def history(self) -> list[Message]:
        """A copy of the conversation so far."""
        return [dict(m) for m in self.messages]  # type: ignore[misc]

    def _commit(self, user: Message) -> Any:
        def on_complete(stream: Stream) -> None:
            with self._lock:
                self.messages.append(user)
                self.messages.append({"role": "assistant", "content": stream.text})

        return on_complete

    def stream(
        self,
        text: str,
        *,
        limits: Limits | None = None,
        capacity: int | None = None,
        schema: Any = None,
        tools: Any = None,
        tool_choice: Any = None,
        tool_call_id: str | None = None,
        **sampling: Any,
    ) -> Stream:
        """Send ``text`` and return the reply's ``Stream`` at once (sync or async use).

        ``schema`` (a pydantic model class or a JSON schema dict) constrains the reply
        to it: ``reply.parsed`` holds the parsed object. ``tools`` (OpenAI-shaped
        functions) and ``tool_choice`` let the reply call one: ``reply.tool_calls``.
        With ``tool_call_id``, ``text`` is that call's result (a ``tool`` turn).
        Raises ``IllegalState`` while the previous turn's stream is still running.
        """
        if not isinstance(text, str):
            raise InvalidArgument(f"a chat turn is a string, got {type(text).__name__}")
        shape = structure(schema, tools, tool_choice, self.model.tool_format)
        with self._lock:
            if self._active is not None and self._active.end_reason is None:
                raise IllegalState("the previous turn is still running; cancel or finish it")
            own = self.model.template_tools
            user: Message = {"role": "user", "content": text}
            if tool_call_id is not None:
                turn = {"role": "tool", "content": text, "tool_call_id": tool_call_id}
                user = render_messages([turn], (), "none", own)[0]
            messages: tuple[Message, ...] = (*self.messages, user)
            tools_text = None
            if shape is not None and shape.tools:
                messages = render_messages(messages, shape.tools, shape.choice, own)
                tools_text = tools_json(shape.tools, shape.choice, own)
            request = GenerationRequest(
                messages=messages,
                sampling=sampling_from(sampling, self._defaults),
                conversation_id=self.conversation_id,
                grammar=shape.grammar if shape else None,
                tools=tools_text,
            )
        stream = self.model.submit(
            request,
            limits=limits,
            capacity=capacity,
            on_complete=self._commit(user),
            structure=shape,
        )
        self._active = stream
        return stream

    def astream(self, text: str, **kwargs: Any) -> Stream:
        """``stream()`` for ``async for``; the same ``Stream`` object serves both."""
        return self.stream(text, **kwargs)

    def send(self, text: str, **kwargs: Any) -> Reply:
        """Send ``text`` and block until the reply ends; Ctrl-C cancels the turn."""
        return self.stream(text, **kwargs).read()

    async def asend(self, text: str, **kwargs: Any) -> Reply:
        """Async ``send()``; cancelling the task cancels the turn."""
        return await self.stream(text, **kwargs).aread()

    def undo(self) -> list[Message]:
        """Remove the last completed turn (user message and reply); returns it."""
        with self._lock:
            for i in range(len(self.messages) - 1, -1, -1):
                if self.messages[i]["role"] == "user":
                    removed = self.messages[i:]
                    del self.messages[i:]
                    return removed
        return []

    def close(self) -> None:
        """Cancel the running turn, if any (``user_cancel``)."""
        if self._active is not None:
            self._active.close()

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> ChatSession:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
