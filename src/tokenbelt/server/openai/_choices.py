"""The pieces of an OpenAI answer that a request's options add: several choices (``n``),
log-probabilities in the chat and legacy shapes, and message content given as parts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..._errors import InvalidArgument
from ...engines import TokenLogprob
from ...runtime import Stream, structured
from ..core import UnsupportedParameter, file_text
from ._schemas import AssistantMessage, Message, ToolMessage

#: content part types that hold an image (answered with a 400 naming the missing vision)
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def messages_for(messages: Sequence[Message], model: str) -> list[dict[str, Any]]:
    """Chat messages as plain dicts for the tool planner (``_tools.plan``).

    ``developer`` becomes ``system``; a list of text parts is joined with newlines (as
    vLLM does); a ``file`` part of text given inline is read as text (``file_text``); an
    image part is a 400 that says the model has no vision; ``null``
    content (allowed only for an ``assistant`` turn that made tool calls) is empty text.
    An assistant's ``tool_calls`` and a tool result's ``tool_call_id`` stay on the dict.
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        content = m.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            texts = []
            for j, part in enumerate(content):
                where = f"messages.{i}.content.{j}"
                if part.type == "file":  # a text file given inline: read as text
                    given = (part.model_extra or {}).get("file")
                    if not isinstance(given, dict):
                        raise UnsupportedParameter(f"{where}.file", "an object with file_data")
                    texts.append(file_text(given, f"{where}.file", model))
                    continue
                if part.type in _IMAGE_PARTS:
                    raise UnsupportedParameter(
                        where, f"{model} has no vision: it reads text only, so it cannot see images"
                    )
                if part.type != "text" or part.text is None:
                    raise UnsupportedParameter(
                        where, f"content parts of type {part.type!r}; {model} reads text parts only"
                    )
                texts.append(part.text)
            text = "\n".join(texts)
        message: dict[str, Any] = {"role": role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        if isinstance(m, AssistantMessage) and m.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if isinstance(m, ToolMessage):
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    orphan = structured.unanswered(out)
    if orphan is not None:
        i, call_id = orphan
        raise InvalidArgument(
            f"messages[{i}]: tool_call_id {call_id!r} is not among the tool_calls of the "
            "assistant message before it; a tool message answers one of those calls",
            param=f"messages.{i}.tool_call_id",
        )
    return out


# -- log-probabilities ------------------------------------------------------------------------


def _entry(t: TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": null}``."""
    content = [{**_entry(t), "top_logprobs": [_entry(a) for a in t.top]} for t in entries]
    return {"content": content, "refusal": None}


def legacy_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """The completions ``logprobs`` object; ``offset`` is where the first token's text
    starts in the choice's text (after an echoed prompt). Each step's ``top_logprobs``
    holds the sampled token too, as OpenAI's does (so up to ``logprobs`` + 1 entries)."""
    offsets = []
    for t in entries:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in entries],
        "token_logprobs": [t.logprob for t in entries],
        "top_logprobs": [
            {**{a.token: a.logprob for a in t.top}, t.token: t.logprob} for t in entries
        ],
        "text_offset": offsets,
    }


class Choice:
    """One choice of an answer: its index, its request's stream, what was sent of it."""

    __slots__ = ("failed", "first", "index", "sent", "sent_ids", "stream")

    def __init__(self, index: int, stream: Stream) -> None:
        self.index = index
        self.stream = stream
        self.first = True
        #: the engine's exception, if it failed
        self.failed: Exception | None = None
        self.sent = 0
        self.sent_ids = 0

    def new_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities read since the last call."""
        read = self.stream.logprobs
        fresh, self.sent = read[self.sent :], len(read)
        return fresh

    def new_token_ids(self) -> list[int]:
        """The token ids read since the last call (``return_token_ids``)."""
        read = self.stream.token_ids
        fresh, self.sent_ids = read[self.sent_ids :], len(read)
        return fresh


async def pieces(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, str | None]]:
    """``(choice, piece)`` as the choices' streams produce them, ``(choice, None)`` when
    one ends (its ``failed`` set if its engine failed).

    Each stream has at most one read outstanding, so each keeps its own backpressure;
    one choice is read directly, without a task per piece.
    """
    if len(choices) == 1:
        only = choices[0]
        try:
            async for piece in only.stream:
                yield only, piece
        except Exception as exc:
            only.failed = exc
        yield only, None
        return
    readers = {c.index: aiter(c.stream) for c in choices}
    pending: dict[asyncio.Future[str], Choice] = {
        asyncio.ensure_future(anext(readers[c.index])): c for c in choices
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t].index):
                choice = pending.pop(task)
                try:
                    piece = task.result()
                except StopAsyncIteration:
                    yield choice, None
                    continue
                except Exception as exc:
                    choice.failed = exc
                    yield choice, None
                    continue
                yield choice, piece
                pending[asyncio.ensure_future(anext(readers[choice.index]))] = choice
    finally:
        for task in pending:
            task.cancel()
