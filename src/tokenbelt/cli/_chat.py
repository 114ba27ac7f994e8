"""``tokenbelt chat``: a terminal chat where Ctrl-C stops the model, not only the printing.

In-process by default (the runtime loads the model here); with ``--url`` it talks
to a running ``tokenbelt serve``. Either way Ctrl-C during a reply cancels the
request with ``user_cancel``, waits for the engine to let go of it, prints one
line of figures and returns to the prompt; Ctrl-C or Ctrl-D at the prompt exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

import httpx
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from .._errors import TokenbeltError
from ..belt import EndReason
from ..runtime import DEFAULT_ALIAS, ChatSession, Runtime, Stream
from ._common import Parser, fail, non_negative_int, positive_int, thread_count

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

    def close(self) -> None: ...


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

    def __init__(self, runtime: Runtime, session: ChatSession) -> None:
        self.runtime = runtime
        self.session = session

    def start(self, text: str) -> LocalTurn:
        return LocalTurn(self.session.stream(text))

    def close(self) -> None:
        self.runtime.close()


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def load_local(
    alias: str,
    console: Console,
    *,
    system: str | None,
    threads: int | None = None,
    threads_batch: int | None = None,
    **sampling: Any,
) -> LocalBackend:
    """Load ``alias`` (or a .gguf path) with a spinner, elapsed time and download progress."""
    runtime = Runtime(keep_alive=None, n_threads=threads, n_threads_batch=threads_batch)
    try:
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

            model = runtime.load(alias, progress=on_progress)
        session = model.chat(system=system, **sampling)
    except BaseException:
        runtime.close()
        raise
    load_s = model.info.get("load_s", "?")
    console.print(f"loaded {model.name} in {load_s} s", style="dim", markup=False)
    return LocalBackend(runtime, session)


# -- over HTTP ----------------------------------------------------------------------------------


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        message = f"{error['message']} (HTTP {response.status_code}, {error.get('code')})"
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
        self.base_url = url.rstrip("/")
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            base_url=self.base_url, headers=self.headers, timeout=httpx.Timeout(10.0, read=None)
        )
        self.model = model
        self.sampling = {k: v for k, v in sampling.items() if v is not None}
        self.messages: list[dict[str, str]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})

    def check(self) -> str:
        """The server's model list, as a line to print; raises ``TurnError``."""
        try:
            response = self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise TurnError(f"cannot reach {self.client.base_url}: {exc}") from exc
        if response.is_error:
            raise TurnError(_error_message(response))
        models = response.json().get("data", [])
        names = [m["id"] for m in models if (m.get("tokenbelt") or {}).get("loaded", True)]
        return ", ".join(names) or "no model loaded yet"

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


def _reply(turn: Turn, console: Console) -> TurnSummary:
    """Print the reply as it streams; Ctrl-C cancels it. Returns the turn's figures."""
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


def chat_loop(backend: Backend, console: Console) -> int:
    """Read a line, stream the reply, print its figures; until Ctrl-D or Ctrl-C at the prompt."""
    while True:
        try:
            text = input(PROMPT)
        except (EOFError, KeyboardInterrupt):
            console.out("")
            return 0
        if not text.strip():
            continue
        try:
            turn = backend.start(text)
        except TokenbeltError as exc:  # refused (queue full, prompt too long, HTTP error)
            console.print(f"error: {exc}", style="red", markup=False)
            continue
        except KeyboardInterrupt:
            console.out("")
            continue
        summary = _reply(turn, console)
        console.print(Text(summary.line(), style="dim"))


# -- the command --------------------------------------------------------------------------------


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= 2:
        raise argparse.ArgumentTypeError(f"temperature must be in 0..2, got {text}")
    return value


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
    p.add_argument("--url", help="talk to a running tokenbelt serve at this URL")
    p.add_argument(
        "--api-key", default=os.environ.get("TOKENBELT_API_KEY"), help="Bearer key for --url"
    )
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=positive_int, help="longest reply, in tokens")
    p.add_argument("--temperature", type=_temperature, help="sampling temperature, 0..2")
    p.add_argument("--seed", type=non_negative_int, help="sampling seed")
    p.add_argument(
        "--threads", type=thread_count, help="llama.cpp decode threads (default: adaptive)"
    )
    p.add_argument(
        "--threads-batch", type=thread_count, help="llama.cpp prompt threads (default: adaptive)"
    )
    p.set_defaults(func=main)


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
            models = remote.check()
        except TurnError as exc:
            remote.close()
            fail(str(exc))
        console.print(f"connected to {args.url} ({models})", style="dim", markup=False)
        backend = remote
    else:
        sampling = {k: v for k, v in sampling.items() if v is not None}
        backend = load_local(
            args.alias or DEFAULT_ALIAS,
            console,
            system=args.system,
            threads=args.threads,
            threads_batch=args.threads_batch,
            **sampling,
        )
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    console.print("Ctrl-C stops a reply; Ctrl-D or Ctrl-C at the prompt exits.", style="dim")
    try:
        return chat_loop(backend, console)
    finally:
        backend.close()
