"""``tokenbelt chat``: a terminal chat where Ctrl-C stops the model, not only the printing.

In-process by default (the runtime loads the model here); with ``--url`` it talks
to a running ``tokenbelt serve``. Either way Ctrl-C during a reply cancels the
request with ``user_cancel``, waits for the engine to let go of it, prints one
line of figures and returns to the prompt; Ctrl-C or Ctrl-D at the prompt exits.
Lines starting with ``/`` are commands (``/help``); see ``_terminal`` for what happens
to keys pressed while a reply streams.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import httpx
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from .._defaults import DEFAULT_MAX_TOKENS
from .._errors import TokenbeltError
from ..belt import EndReason
from ..runtime import DEFAULT_ALIAS, ChatSession, Model, Runtime, Stream
from ._common import (
    Parser,
    add_isolation_options,
    fail,
    missing_model_file,
    sampling_value,
    startup_line,
    thread_count,
)
from ._terminal import Command, QuietKeys, clear_draft, help_text, offer_draft

PROMPT = "you> "
#: how long a turn may take to be released after it ended, before we stop waiting
RELEASE_WAIT_S = 5.0
NATURAL_ENDS = frozenset({"stop", "length"})


class TurnError(TokenbeltError):
    """The server refused a turn (an HTTP error); the chat goes on."""


@dataclass(frozen=True)
class TurnSummary:
    """The figures printed after each reply, from the request's trace."""

    end_reason: str | None
    time_to_first_token_ms: float | None
    decode_tok_s: float | None
    cancel_to_release_ms: float | None
    released: bool
    completion_tokens: int | None = None
    prompt_tokens: int | None = None

    @classmethod
    def from_trace(cls, trace: dict[str, Any] | None) -> TurnSummary:
        if trace is None:
            return cls(None, None, None, None, False)
        return cls(
            end_reason=trace.get("end_reason"),
            time_to_first_token_ms=trace.get("time_to_first_token_ms"),
            decode_tok_s=trace.get("decode_tok_s"),
            cancel_to_release_ms=trace.get("cancel_to_release_ms"),
            released=(trace.get("timeline_ms") or {}).get("released") is not None,
            completion_tokens=trace.get("completion_tokens"),
            prompt_tokens=trace.get("prompt_tokens"),
        )

    def length_hint(self, max_tokens: int) -> str | None:
        """Why a reply that ended ``length`` stopped, and what to do about it."""
        if self.end_reason != "length":
            return None
        if self.completion_tokens is not None and self.completion_tokens < max_tokens:
            return (
                "the reply stopped because the context is full; /clear or /undo make room "
                "(or serve with a larger --n-ctx)"
            )
        return (
            f"the reply stopped at the {max_tokens}-token limit; "
            "start the chat with --max-tokens N for longer replies"
        )

    def line(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        rate = "-" if self.decode_tok_s is None else f"{self.decode_tok_s:.1f}"
        released = "" if self.released else " (not released yet)"
        return (
            f"first token {ms(self.time_to_first_token_ms)}, {rate} tok/s, "
            f"end {self.end_reason or 'unknown'}, "
            f"cancel to release {ms(self.cancel_to_release_ms)}{released}"
        )


class Turn(Protocol):
    """One reply in flight."""

    def __iter__(self) -> Iterator[str]: ...

    def cancel(self) -> None:
        """Stop generation (``user_cancel``); returns without waiting for the release."""

    def summary(self) -> TurnSummary:
        """Wait (bounded) for the release, then summarise the turn's trace."""


class Backend(Protocol):
    def start(self, text: str) -> Turn: ...

    def clear(self) -> None:
        """Forget the conversation; the system prompt stays."""

    def undo(self) -> bool:
        """Take back the last exchange; False when there is none."""

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None removes it)."""

    def switch(self, name: str) -> str:
        """Use model ``name`` from now on; returns a line describing it. Raises on failure."""

    def close(self) -> None: ...


def _set_system(messages: list[Any], text: str | None) -> None:
    messages[:] = [m for m in messages if m["role"] != "system"]
    if text:
        messages.insert(0, {"role": "system", "content": text})


def _undo(messages: list[Any]) -> bool:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            del messages[i:]
            return True
    return False


# -- in-process ---------------------------------------------------------------------------------


class LocalTurn:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[str]:
        return iter(self.stream)

    def cancel(self) -> None:
        self.stream.cancel(EndReason.USER_CANCEL)

    def summary(self) -> TurnSummary:
        self.stream.wait_released(RELEASE_WAIT_S)
        return TurnSummary.from_trace(self.stream.trace.to_dict())


class LocalBackend:
    """The runtime in this process; the session keeps the conversation."""

    def __init__(
        self,
        runtime: Runtime,
        model: Model,
        session: ChatSession,
        console: Console,
        sampling: dict[str, Any],
    ) -> None:
        self.runtime = runtime
        self.model = model
        self.session = session
        self.console = console
        self.sampling = sampling
        #: the latest turn's stream
        self.last: Stream | None = None

    def start(self, text: str) -> LocalTurn:
        stream = self.session.stream(text)
        self.last = stream
        return LocalTurn(stream)

    def clear(self) -> None:
        self.session.messages[:] = [m for m in self.session.messages if m["role"] == "system"]

    def undo(self) -> bool:
        return bool(self.session.undo())

    def set_system(self, text: str | None) -> None:
        _set_system(self.session.messages, text)

    def switch(self, name: str) -> str:
        missing = missing_model_file(name)
        if missing is not None:
            raise TurnError(f"file not found: {missing}")
        if Runtime.name_for(name) == self.model.name:
            return f"already using {self.model.name}"
        model = _load_with_progress(self.runtime, name, self.console)
        session = model.chat(**self.sampling)
        session.messages[:] = self.session.messages
        old, self.model, self.session = self.model, model, session
        self.runtime.unload(old.name)
        return _loaded_line(model, self.runtime)

    def close(self) -> None:
        self.runtime.close()


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _load_with_progress(runtime: Runtime, alias: str, console: Console) -> Model:
    """Load ``alias`` (or a .gguf path) with a spinner, elapsed time and download progress."""
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"loading {alias}", total=None, detail="")

        def on_progress(received: int, total: int | None) -> None:
            detail = _mb(received) + (f" / {_mb(total)}" if total else "")
            progress.update(task, description=f"downloading {alias}", detail=detail)
            if total and received >= total:
                progress.update(task, description=f"loading {alias}", detail="")

        return runtime.load(alias, progress=on_progress)


def _loaded_line(model: Model, runtime: Runtime) -> str:
    return f"loaded in {model.info.get('load_s', '?')} s: {startup_line(model, runtime)}"


def load_local(
    alias: str,
    console: Console,
    *,
    system: str | None,
    threads: int | None = None,
    threads_batch: int | None = None,
    isolation: str = "thread",
    stop_grace: float = 3.0,
    **sampling: Any,
) -> LocalBackend:
    """Load ``alias`` and start a session on it; prints the startup line."""
    runtime = Runtime(
        keep_alive=None,
        n_threads=threads,
        n_threads_batch=threads_batch,
        isolation=isolation,
        stop_grace=stop_grace,
    )
    try:
        model = _load_with_progress(runtime, alias, console)
        session = model.chat(system=system, **sampling)
    except BaseException:
        runtime.close()
        raise
    console.print(_loaded_line(model, runtime), style="dim", markup=False)
    return LocalBackend(runtime, model, session, console, sampling)


# -- over HTTP ----------------------------------------------------------------------------------


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
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    self.pieces.append(piece)
                    yield piece
        self.response.close()

    def _send_cancel(self) -> None:
        """``POST /v1/requests/{id}/cancel`` once, on a connection of its own.

        Its own connection because it may run inside a signal handler, while the main
        client is in the middle of reading the stream.
        """
        if self.request_id is None or self._cancel_sent:
            return
        self._cancel_sent = True
        url = f"{self.backend.base_url}/v1/requests/{self.request_id}/cancel"
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(url, headers=self.backend.headers, timeout=5.0)

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
        return _undo(self.messages)

    def set_system(self, text: str | None) -> None:
        _set_system(self.messages, text)

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


# -- the loop -----------------------------------------------------------------------------------


def _reply(turn: Turn, console: Console, keys: QuietKeys) -> TurnSummary:
    """Print the reply as it streams; Ctrl-C cancels it. Returns the turn's figures.

    Keys typed meanwhile are held by ``keys`` (neither echoed nor sent).
    """
    with keys.held():
        try:
            for piece in turn:
                console.out(piece, end="", highlight=False)
        except KeyboardInterrupt:
            turn.cancel()
            console.out("")
            console.print("[stopped]", style="yellow", markup=False)
        except (TokenbeltError, httpx.HTTPError, ValueError) as exc:
            turn.cancel()
            console.out("")
            console.print(f"error: {exc}", style="red", markup=False)
        else:
            console.out("")
        try:
            return turn.summary()
        except KeyboardInterrupt:  # a second Ctrl-C while waiting for the release
            turn.cancel()
            return TurnSummary(EndReason.USER_CANCEL.value, None, None, None, False)


def _note(console: Console, text: str, style: str = "dim") -> None:
    console.print(text, style=style, markup=False, highlight=False)


def _command(backend: Backend, console: Console, command: Command) -> bool:
    """Run one slash command; False when the chat should end."""
    name, arg = command.name, command.arg
    if name == "/exit":
        return False
    if name == "/help":
        _note(console, help_text(), style="")
    elif name == "/clear":
        backend.clear()
        _note(console, "conversation cleared")
    elif name == "/undo":
        _note(console, "took back the last exchange" if backend.undo() else "nothing to undo")
    elif name == "/system":
        backend.set_system(arg or None)
        _note(console, f"system prompt: {arg}" if arg else "system prompt removed")
    elif name == "/model":
        if not arg:
            _note(console, "usage: /model NAME", style="red")
            return True
        try:
            _note(console, backend.switch(arg))
        except TokenbeltError as exc:
            _note(console, f"error: {exc}", style="red")
    else:
        _note(
            console,
            f"unknown command {name}; /help lists them (start with // to send a message "
            "that begins with /)",
            style="red",
        )
    return True


def chat_loop(backend: Backend, console: Console, max_tokens: int) -> int:
    """Read a line, stream the reply, print its figures; until /exit, Ctrl-D or Ctrl-C."""
    keys = QuietKeys()
    while True:
        try:
            line = input(PROMPT)
        except (EOFError, KeyboardInterrupt):
            console.out("")
            return 0
        finally:
            clear_draft()
        if not line.strip():
            continue
        command = Command.parse(line)
        if command.name is not None:
            if not _command(backend, console, command):
                return 0
            continue
        try:
            turn = backend.start(command.arg)
        except TokenbeltError as exc:  # refused (queue full, prompt too long, HTTP error)
            _note(console, f"error: {exc}", style="red")
            continue
        except KeyboardInterrupt:
            console.out("")
            continue
        summary = _reply(turn, console, keys)
        console.print(Text(summary.line(), style="dim"))
        hint = summary.length_hint(max_tokens)
        if hint is not None:
            _note(console, hint, style="yellow")
        draft = keys.take_draft()
        if draft:
            if offer_draft(draft):
                _note(console, "what you typed during the reply is your draft: Enter sends it")
            else:
                _note(console, f"not sent (typed during the reply): {draft}")


# -- the command --------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "chat",
        help="chat in the terminal; Ctrl-C stops a reply, Ctrl-D exits",
        description=(
            "Chat with a model in the terminal (in-process, or with --url a running server). "
            "Ctrl-C stops the reply and the model with it; Ctrl-C or Ctrl-D at the prompt exits."
        ),
    )
    p.add_argument(
        "alias",
        nargs="?",
        help=f"model alias or .gguf path (default {DEFAULT_ALIAS}; with --url: the server's "
        "model id, default the server's first)",
    )
    p.add_argument(
        "--url",
        help="talk to a running tokenbelt serve at this URL (its root or its /v1 address)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TOKENBELT_API_KEY"),
        help="Bearer key for --url (default: $TOKENBELT_API_KEY)",
    )
    p.add_argument("--system", help="system prompt (default: none)")
    p.add_argument(
        "--max-tokens",
        type=sampling_value("max_tokens", int),
        default=DEFAULT_MAX_TOKENS,
        help="longest reply, in tokens",
    )
    p.add_argument(
        "--temperature",
        type=sampling_value("temperature", float),
        help="sampling temperature, 0..2 (default: model's)",
    )
    p.add_argument(
        "--seed", type=sampling_value("seed", int), help="sampling seed (default: random)"
    )
    p.add_argument(
        "--threads", type=thread_count, help="llama.cpp decode threads (default: adaptive)"
    )
    p.add_argument(
        "--threads-batch", type=thread_count, help="llama.cpp prompt threads (default: adaptive)"
    )
    add_isolation_options(p)
    p.set_defaults(func=main)
    p.epilog = f"commands at the prompt:\n{help_text()}\n\n{p.epilog}"


def main(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    backend: Backend
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            fail(f"--url must start with http:// or https://, got {args.url!r}", 2)
        remote = RemoteBackend(
            args.url, model=args.alias, system=args.system, api_key=args.api_key, sampling=sampling
        )
        try:
            described = remote.check()
        except TurnError as exc:
            remote.close()
            fail(str(exc))
        _note(console, f"connected to {remote.base_url}: {described}")
        backend = remote
    else:
        alias = args.alias or DEFAULT_ALIAS
        missing = missing_model_file(alias)
        if missing is not None:
            fail(f"file not found: {missing}")
        sampling = {k: v for k, v in sampling.items() if v is not None}
        backend = load_local(
            alias,
            console,
            system=args.system,
            threads=args.threads,
            threads_batch=args.threads_batch,
            isolation=args.isolation,
            stop_grace=args.stop_grace,
            **sampling,
        )
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    _note(console, "/help lists the commands; Ctrl-C stops a reply; /exit or Ctrl-D leaves.")
    previous = signal.signal(signal.SIGTERM, _on_terminate(backend))
    try:
        return chat_loop(backend, console, args.max_tokens)
    except Terminated:
        console.out("")
        last = backend.last if isinstance(backend, LocalBackend) else None
        if last is not None and last.wait_released(RELEASE_WAIT_S) and last.end_reason:
            _note(console, f"terminated (SIGTERM): the reply ended with {last.end_reason.value}")
        else:
            _note(console, "terminated (SIGTERM)")
        return 0
    finally:
        backend.close()
        signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """Raised on the main thread by SIGTERM, wherever the chat was (a BaseException, as
    ``KeyboardInterrupt``: no ``except Exception`` on the way may swallow it)."""


def _on_terminate(backend: Backend) -> Callable[[int, FrameType | None], None]:
    """SIGTERM: end the running turn with ``shutdown`` and leave; a second one exits now."""
    terminating = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal terminating
        if terminating:
            os._exit(128 + signum)
        terminating = True
        if isinstance(backend, LocalBackend):
            # Ends every request with shutdown before the exception unwinds the reader,
            # whose own stop (user_cancel) then comes second and is ignored. On its own
            # thread: this handler may have interrupted code that holds a lock it needs.
            drain = threading.Thread(target=backend.runtime.drain, args=(0,), daemon=True)
            drain.start()
            drain.join(1.0)
        raise Terminated

    return handler
