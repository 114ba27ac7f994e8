"""Chat: a model's one-off streams (``ChatCalls``, the chat surface of ``Model``) and
sessions, a conversation kept across turns, with sync and async sending."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import IllegalState, InvalidArgument
from ..belt import Limits
from ..engines import GenerationRequest, Message, sampling_from
from ._stream import Reply, Stream
from ._structured import Structure, render_messages, structure, tools_json

if TYPE_CHECKING:
    from ._model import Model


class ChatCalls:
    """The chat surface of ``Model`` over its ``submit`` and what its template renders."""

    @property
    def tool_format(self) -> str:
        raise NotImplementedError

    @property
    def template_tools(self) -> bool:
        raise NotImplementedError

    def submit(
        self,
        request: GenerationRequest,
        *,
        limits: Limits | None = None,
        capacity: int | None = None,
        structure: Structure | None = None,
    ) -> Stream:
        raise NotImplementedError

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
