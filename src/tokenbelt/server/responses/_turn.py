"""One response as it is made: the ``response`` object and its stream of events.

A ``Turn`` is fed the chat deltas that ``openai._tools.Deltas`` makes of the model's
text (``content`` and ``tool_calls``), so a call is parsed here exactly as on
``/v1/chat/completions``; it turns them into Responses events, numbered by
``sequence_number``, and keeps the ``response`` object that the terminal event, a
non-streamed answer, a ``GET`` and a cancel all return. A response that was not
streamed is the same turn fed its whole text at once, so both shapes agree.

Every end has exactly one terminal event and one ``status``:

=====================================  ============  ======================
end reason                             status        terminal event
=====================================  ============  ======================
``stop``                               completed     ``response.completed``
``length``                             incomplete    ``response.incomplete``
a cancel, a disconnect, a slow reader  cancelled     ``response.incomplete``
a deadline, shutdown, a failure        failed        ``response.failed``
=====================================  ============  ======================

The exact end reason and the trace are under ``tokenbelt`` in the final object.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ...belt import EndReason
from ...runtime import Stream
from ..core import failure, tokenbelt_final
from ._items import call_item, message_item, new_id, reasoning_item, text_part

_NATURAL = (EndReason.STOP, EndReason.LENGTH)
_CANCELLED = frozenset(
    {EndReason.USER_CANCEL, EndReason.CLIENT_DISCONNECT, EndReason.READER_TIMEOUT}
)


def status_for(reason: EndReason, failed: bool = False) -> str:
    if failed:
        return "failed"
    if reason is EndReason.STOP:
        return "completed"
    if reason is EndReason.LENGTH:
        return "incomplete"
    if reason in _CANCELLED:
        return "cancelled"
    return "failed"


_TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


def usage_of(stream: Stream) -> dict[str, Any]:
    u = stream.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens or 0},
        "total_tokens": u.total_tokens,
    }


class Turn:
    """The response ``response_id`` being made from ``stream``; ``echo`` is the part of
    the request a response object repeats (instructions, tools, sampling...)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        echo: dict[str, Any],
        namespaces: dict[str, str] | None = None,
    ) -> None:
        self.id = response_id
        #: function name -> the ``namespace`` tool it was offered from
        self.namespaces = namespaces or {}
        self.response: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "completed_at": None,
            "status": "in_progress",
            "model": model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **echo,
        }
        self.sequence = 0
        #: set once the terminal event is made (a cancel waits for it)
        self.finished = asyncio.Event()
        self._open: dict[str, Any] | None = None
        #: the open message's text so far, piece by piece (joined once, when it closes)
        self._written: list[str] = []
        #: more for the final object's ``tokenbelt`` (what the request had left out...)
        self.extension: dict[str, Any] = {}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands (a copy: later events do not change it)."""
        return {**self.response, "output": [dict(item) for item in self.response["output"]]}

    def start(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.snapshot()),
            self.event("response.in_progress", response=self.snapshot()),
        ]

    # -- output items --------------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = item
        index = len(self.response["output"])
        self.response["output"].append(item)
        return [self.event("response.output_item.added", output_index=index, item=dict(item))]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.response["output"]) - 1}

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != "message":
            events += self._close("completed")
            events += self._add(message_item(new_id("msg"), "", "in_progress"))
            part = text_part("")
            events.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
            self._written = []
        self._written.append(text)
        events.append(
            self.event(
                "response.output_text.delta",
                **self._where(),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        """The events of a thinking model's reasoning text: its item (opened first)."""
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close("completed")
            events += self._add(reasoning_item(new_id("rs"), "", "in_progress"))
            self._written = []
        self._written.append(text)
        events.append(
            self.event(
                "response.reasoning_text.delta", **self._where(), content_index=0, delta=text
            )
        )
        return events

    def _call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        events = self._close("completed")
        space = self.namespaces.get(name)
        return events + self._add(call_item(new_id("fc"), call_id, name, "", "in_progress", space))

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        assert self._open is not None
        assert self._open["type"] == "function_call"
        self._open["arguments"] += text
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=text)]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        events: list[dict[str, Any]] = []
        if item["type"] == "reasoning":
            text = "".join(self._written)
            done = reasoning_item(item["id"], text, status)
            events.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        elif item["type"] == "message":
            text = "".join(self._written)
            done = message_item(item["id"], text, status)
            part = done["content"][0]
            events.append(
                self.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            done = call_item(
                item["id"],
                item["call_id"],
                item["name"],
                item["arguments"],
                status,
                item.get("namespace"),
            )
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        self.response["output"][where["output_index"]] = done
        self._open = None
        events.append(
            self.event(
                "response.output_item.done", output_index=where["output_index"], item=dict(done)
            )
        )
        return events

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (``content`` or one ``tool_calls`` entry)."""
        if "content" in delta:
            return self._text(delta["content"]) if delta["content"] else []
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "name" in fn:
                events += self._call(call.get("id") or new_id("call"), fn["name"])
            if fn.get("arguments"):
                events += self._arguments(fn["arguments"])
        return events

    def finish(
        self, stream: Stream, called: bool, failed: Exception | None = None
    ) -> list[dict[str, Any]]:
        """The last events: the open item closed, then the one terminal event.

        ``called``: the reply's call parsed whole (else an open call was cut short).
        """
        reason = stream.end_reason or EndReason.RUNTIME_ERROR
        status = status_for(reason, failed is not None)
        open_call = self._open is not None and self._open["type"] == "function_call"
        whole = status == "completed" and (called or not open_call)
        item_status = "completed" if whole else "incomplete"
        events = self._close(item_status)
        answered = any(item["type"] != "reasoning" for item in self.response["output"])
        if not answered and stream.trace.phase != "reasoning" and reason in _NATURAL:
            # an empty answer is still one message
            empty = message_item(new_id("msg"), "", item_status)
            self.response["output"].append(empty)
        self.response["status"] = status
        self.response["usage"] = usage_of(stream)
        self.response["completed_at"] = int(time.time()) if status == "completed" else None
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "failed":
            self.response["error"] = _error(reason, failed)
        self.response["tokenbelt"] = {**tokenbelt_final(stream), **self.extension}
        events.append(self.event(_TERMINAL[status], response=self.snapshot()))
        self.finished.set()
        return events


def _error(reason: EndReason, failed: Exception | None) -> dict[str, str]:
    if failed is not None:
        _status, _type, code = failure(failed)
        return {"code": code or "server_error", "message": f"generation failed: {failed}"}
    if reason is EndReason.SHUTDOWN:
        return {"code": "shutdown", "message": "the server is shutting down"}
    return {"code": reason.value, "message": f"the response ended with {reason.value}"}
