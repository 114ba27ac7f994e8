"""The HTTP backend of ``tokenbelt chat --url``: a small SSE client of a ``tokenbelt serve``.

Each turn is one streamed ``POST /v1/chat/completions``. A stop is
``POST /v1/requests/{id}/cancel`` first (so the server records ``user_cancel``), then
the hang-up; the figures come from the trace in the stream's last chunk, or from
``GET /v1/requests/{id}`` until it shows the release. The client keeps the history and
sends it whole with every turn.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from ..engines import Piece
from ._chat_backend import (
    NATURAL_ENDS,
    RELEASE_WAIT_S,
    TurnError,
    TurnSummary,
    set_system_prompt,
    undo_exchange,
)


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        code = f", {error['code']}" if error.get("code") else ""
        message = f"{error['message']} (HTTP {response.status_code}{code})"
    except (ValueError, KeyError, TypeError):
        message = f"HTTP {response.status_code}"
    retry = response.headers.get("retry-after")
    return f"{message}; retry after {retry} s" if retry else message


class RemoteTurn:
    def __init__(self, backend: RemoteBackend, user: dict[str, str], body: dict[str, Any]) -> None:
        self.backend = backend
        self.user = user
        self.pieces: list[str] = []
        self.trace: dict[str, Any] | None = None
        self._cancel_sent = False
        client = backend.client
        request = client.build_request("POST", "/v1/chat/completions", json=body)
        self.response = client.send(request, stream=True)
        if self.response.is_error:
            self.response.read()
            self.response.close()
            raise TurnError(_error_message(self.response))
        self.request_id = self.response.headers.get("x-request-id")

    def __iter__(self) -> Iterator[str]:
        # A Ctrl-C raised inside httpx's read would close the connection on its way out
        # (httpcore closes a stream on any exception), and the server would record
        # client_disconnect before our cancel call arrived. So while the reply streams,
        # Ctrl-C first makes the cancel call, then interrupts.
        previous = signal.getsignal(signal.SIGINT)

        def on_interrupt(signum: int, frame: FrameType | None) -> None:
            signal.signal(signal.SIGINT, previous)  # a second Ctrl-C stops waiting for it
            self._send_cancel()
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_interrupt)
        try:
            yield from self._read()
        finally:
            signal.signal(signal.SIGINT, previous)

    def _read(self) -> Iterator[str]:
        for line in self.response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            extra = chunk.get("tokenbelt") or {}
            if "trace" in extra:
                self.trace = extra["trace"]
            if chunk.get("error"):
                raise TurnError(chunk["error"].get("message", "the generation failed"))
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                thought = delta.get("reasoning_content")
                if thought:  # a thinking model's reasoning: shown, not kept in the history
                    yield Piece("", (), thought)
                piece = delta.get("content")
                if piece:
                    self.pieces.append(piece)
                    yield piece
        self.response.close()

    def _send_cancel(self) -> None:
        """``POST /v1/requests/{id}/cancel`` once, on a connection of its own (the
        backend's cancel client).

        Its own connection because it may run inside a signal handler, while the main
        client is in the middle of reading the stream.
        """
        if self.request_id is None or self._cancel_sent:
            return
        self._cancel_sent = True
        with contextlib.suppress(httpx.HTTPError):
            self.backend.cancel_client.post(f"/v1/requests/{self.request_id}/cancel")

    def cancel(self) -> None:
        # First the cancel call, so that the server records user_cancel; only then hang
        # up (a hang-up alone would be recorded as client_disconnect).
        self._send_cancel()
        self.response.close()

    def _final_trace(self) -> dict[str, Any] | None:
        """The stream's last chunk carries the released trace; after a cancel, ask for it.

        The cancel call returns before the engine lets go, so poll (bounded) until the
        server's record shows the release.
        """
        trace = self.trace
        deadline = time.monotonic() + RELEASE_WAIT_S
        delay = 0.02
        while self.request_id is not None and not TurnSummary.from_trace(trace).released:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = self.backend.client.get(f"/v1/requests/{self.request_id}")
                if response.is_success:
                    trace = response.json()
            if TurnSummary.from_trace(trace).released or time.monotonic() + delay > deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
        return trace

    def summary(self) -> TurnSummary:
        self.response.close()
        trace = self._final_trace()
        summary = TurnSummary.from_trace(trace)
        # As in the SDK's sessions: only a reply that ended on its own joins the history.
        if summary.end_reason in NATURAL_ENDS:
            reply = {"role": "assistant", "content": "".join(self.pieces)}
            self.backend.messages += [self.user, reply]
        return summary


def server_root(url: str) -> str:
    """The server's root from what a user may give: the root, or the API's ``/v1``."""
    root = url.rstrip("/")
    return root.removesuffix("/v1").rstrip("/")


class RemoteBackend:
    """A ``tokenbelt serve`` (or any server speaking its protocol) at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None,
        system: str | None,
        api_key: str | None,
        sampling: dict[str, Any],
    ) -> None:
        self.base_url = server_root(url)
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            base_url=self.base_url, headers=self.headers, timeout=httpx.Timeout(10.0, read=None)
        )
        # The cancel call's own pool, made now: a client made at Stop first loads the CA
        # bundle into a new SSL context (~65 ms here) before it sends a byte.
        self.cancel_client = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=5.0)
        self.model = model
        self.sampling = {k: v for k, v in sampling.items() if v is not None}
        self.messages: list[dict[str, str]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})

    def _usable_models(self) -> list[dict[str, Any]]:
        """The server's models that can answer now or soon (loaded or loading)."""
        try:
            response = self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise TurnError(f"cannot reach {self.base_url}: {exc}") from exc
        if response.status_code == 404:
            raise TurnError(
                f"{self.base_url} does not answer /v1/models (HTTP 404): is it a tokenbelt "
                "serve or another OpenAI-compatible server? Give its root address"
            )
        if response.is_error:
            raise TurnError(_error_message(response))
        try:
            models = response.json().get("data", [])
        except (ValueError, AttributeError) as exc:
            raise TurnError(f"{self.base_url}/v1/models did not answer JSON") from exc
        usable = []
        for m in models:
            tb = m.get("tokenbelt") or {}
            state = (tb.get("load") or {}).get("state")
            if tb.get("loaded", True) or state == "loading":
                usable.append(m)
        return usable

    def _find(self, name: str, models: list[dict[str, Any]]) -> dict[str, Any]:
        wanted = {name, Path(name).stem} if name.endswith(".gguf") else {name}
        for m in models:
            if m.get("id") in wanted:
                return m
        have = ", ".join(m["id"] for m in models) or "none"
        raise TurnError(f"the server at {self.base_url} has no model {name!r} (it has: {have})")

    def check(self) -> str:
        """A line about the server's model; raises ``TurnError`` if it has not the one asked."""
        models = self._usable_models()
        if self.model is not None:
            return self._describe(self._find(self.model, models))
        if not models:
            return "no model loaded yet"
        return self._describe(models[0])

    @staticmethod
    def _describe(entry: dict[str, Any]) -> str:
        tb = entry.get("tokenbelt") or {}
        info = tb.get("info") or {}
        parts = [f"model {entry['id']}"]
        if info.get("device"):
            parts.append(f"on {info['device']}")
        if tb.get("context_length"):
            parts.append(f"context {tb['context_length']} tokens")
        if tb.get("slots"):
            parts.append(f"{tb['slots']} slot{'s' if tb['slots'] != 1 else ''}")
        if info.get("path"):
            parts.append(f"file {info['path']}")
        if not tb.get("loaded", True):
            parts.append("still loading")
        return ", ".join(parts)

    def clear(self) -> None:
        self.messages[:] = [m for m in self.messages if m["role"] == "system"]

    def undo(self) -> bool:
        return undo_exchange(self.messages)

    def set_system(self, text: str | None) -> None:
        set_system_prompt(self.messages, text)

    def switch(self, name: str) -> str:
        entry = self._find(name, self._usable_models())
        self.model = entry["id"]
        return self._describe(entry)

    def start(self, text: str) -> RemoteTurn:
        user = {"role": "user", "content": text}
        body: dict[str, Any] = {
            "messages": [*self.messages, user],
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.sampling,
        }
        if self.model is not None:
            body["model"] = self.model
        try:
            return RemoteTurn(self, user, body)
        except httpx.HTTPError as exc:
            raise TurnError(f"the request failed: {exc}") from exc

    def close(self) -> None:
        self.client.close()
        self.cancel_client.close()
