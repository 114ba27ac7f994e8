"""``tokenbelt chat``: a terminal chat where Ctrl-C stops the model, not only the printing.

In-process by default (the runtime loads the model here); with ``--url`` it talks
to a running ``tokenbelt serve``. Either way Ctrl-C during a reply cancels the
request with ``user_cancel``, waits for the engine to let go of it, prints one
line of figures and returns to the prompt; Ctrl-C or Ctrl-D at the prompt exits.
Lines starting with ``/`` are commands (``/help``); see ``_terminal`` for what happens
to keys pressed while a reply streams.

This module is the loop and the command; the backends are ``_chat_local`` (in-process)
and ``_chat_remote`` (over HTTP), both serving the contract in ``_chat_backend``;
SIGTERM is handled in ``_chat_signals``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal

import httpx
from rich.console import Console
from rich.text import Text

from .._defaults import DEFAULT_MAX_TOKENS
from .._errors import TokenbeltError
from ..belt import EndReason
from ..engines import Piece
from ..runtime import DEFAULT_ALIAS
from ._chat_backend import RELEASE_WAIT_S, Backend, Turn, TurnError, TurnSummary
from ._chat_local import LocalBackend, load_local
from ._chat_remote import RemoteBackend
from ._chat_signals import PromptInterrupts, Terminated, on_terminate
from ._common import (
    Parser,
    add_isolation_options,
    fail,
    missing_model_file,
    sampling_value,
    thread_count,
)
from ._terminal import Command, QuietKeys, WordWrap, clear_draft, help_text, offer_draft

PROMPT = "you> "


def _reply(turn: Turn, console: Console, keys: QuietKeys) -> TurnSummary:
    """Print the reply as it streams; Ctrl-C cancels it. Returns the turn's figures.

    Keys typed meanwhile are held by ``keys`` (neither echoed nor sent).
    """
    # On a terminal, words are not cut at its edge; piped output is the text as it is.
    wrap = WordWrap(console.width) if console.is_terminal else None
    with keys.held():
        thinking = False
        try:
            for piece in turn:
                thought = piece.reasoning if isinstance(piece, Piece) else ""
                if thought:
                    # A thinking model's reasoning, dim, before its answer.
                    text = wrap.feed(thought) if wrap else thought
                    console.out(text, end="", style="dim", highlight=False)
                    thinking = True
                if piece:
                    if thinking:  # the reasoning's last word, then the answer's own line
                        console.out(wrap.feed("\n") if wrap else "\n", end="", style="dim")
                        thinking = False
                    console.out(wrap.feed(piece) if wrap else piece, end="", highlight=False)
        except KeyboardInterrupt:
            turn.cancel()
            console.out(wrap.finish() if wrap else "")
            console.print("[stopped]", style="yellow", markup=False)
        except (TokenbeltError, httpx.HTTPError, ValueError) as exc:
            turn.cancel()
            console.out(wrap.finish() if wrap else "")
            console.print(f"error: {exc}", style="red", markup=False)
        else:
            console.out(wrap.finish() if wrap else "")
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


def chat_loop(
    backend: Backend, console: Console, max_tokens: int, interrupts: PromptInterrupts
) -> int:
    """Read a line, stream the reply, print its figures; until /exit, Ctrl-D or Ctrl-C."""
    keys = QuietKeys()
    while True:
        try:
            with interrupts.prompting():
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
    previous = signal.signal(signal.SIGTERM, on_terminate(backend))
    # Ctrl-C is the chat's Stop key: started with SIGINT ignored (as a shell without job
    # control starts a background command), the chat still takes it.
    interrupts = PromptInterrupts()
    interrupts.install()
    try:
        return chat_loop(backend, console, args.max_tokens, interrupts)
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
        interrupts.close()
