"""The terminal side of ``tokenbelt chat``: slash commands, and keys pressed during a reply.

While a reply streams, the terminal neither echoes nor line-buffers what is typed
(``termios``: ``ECHO`` and ``ICANON`` off, signals on, ``NOFLSH``), so keystrokes never
land inside the reply and Ctrl-C prints no ``^C`` there; it still raises
``KeyboardInterrupt`` and keeps what was typed before it.
When the reply ends, whatever was typed is read back and offered as the next prompt's
draft (pre-filled through ``readline``): it is never sent until Enter is pressed at
the prompt. Without ``readline`` the draft is dropped, and the chat says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from rich.cells import cell_len

COMMANDS = {
    "/help": "this list",
    "/clear": "forget the conversation (the system prompt stays)",
    "/undo": "take back the last question and its reply",
    "/system TEXT": "set the system prompt (/system alone removes it)",
    "/model NAME": "switch to another model; the conversation goes on",
    "/exit": "leave (also exit, quit or Ctrl-D)",
}
_ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|O.|.)?")
EXIT_WORDS = frozenset({"/exit", "/quit", "exit", "quit"})


def help_text() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    lines.append(f"  {'//TEXT':<{width}}  send a message that starts with /")
    lines.append("Ctrl-C stops a reply; text typed during a reply becomes your next draft.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Command:
    """A line typed at the prompt: a command with its argument, or a message."""

    name: str | None  # None: a message to send
    arg: str

    @classmethod
    def parse(cls, line: str) -> Command:
        text = line.strip()
        if text.lower() in EXIT_WORDS:
            return cls("/exit", "")
        if text.startswith("//"):
            return cls(None, line.strip()[1:])
        if text.startswith("/"):
            name, _, arg = text.partition(" ")
            return cls(name.lower(), arg.strip())
        return cls(None, line)


def clean_typed(raw: bytes) -> str:
    """What a person typed, as text: backspaces applied, newlines as spaces, no controls
    or escape sequences."""
    out: list[str] = []
    # Arrow, function and editing keys arrive as escape sequences: they are not text.
    typed = _ESCAPES.sub("", raw.decode("utf-8", "replace"))
    for ch in typed:
        if ch in ("\x7f", "\b"):
            if out:
                out.pop()
        elif ch in ("\r", "\n", "\t"):
            out.append(" ")
        elif ch == "\x15":  # Ctrl-U: the line so far is gone
            out.clear()
        elif ch.isprintable():
            out.append(ch)
    return " ".join("".join(out).split())


class QuietKeys:
    """Hold keystrokes typed while a reply streams; see the module's docstring."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = sys.stdin.fileno() if fd is None else fd
        self.typed = b""

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        try:
            import termios
        except ImportError:  # not POSIX: the terminal stays as it is
            yield
            return
        if not os.isatty(self.fd):
            yield
            return
        saved = termios.tcgetattr(self.fd)
        quiet = termios.tcgetattr(self.fd)
        quiet[3] &= ~(termios.ECHO | termios.ICANON)
        quiet[3] |= termios.NOFLSH  # Ctrl-C must not throw away what was typed before it
        quiet[6][termios.VMIN] = 1
        quiet[6][termios.VTIME] = 0
        termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        try:
            yield
        finally:
            self.typed = self._drain()
            termios.tcsetattr(self.fd, termios.TCSANOW, saved)

    def _drain(self) -> bytes:
        """Everything waiting in the terminal's input, so none of it is read as a line."""
        chunks = []
        while select.select([self.fd], [], [], 0)[0]:
            chunk = os.read(self.fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def take_draft(self) -> str:
        text, self.typed = clean_typed(self.typed), b""
        return text


def offer_draft(draft: str) -> bool:
    """Pre-fill the next ``input()`` with ``draft``; False when there is no readline."""
    try:
        import readline
    except ImportError:
        return False

    readline.set_startup_hook(lambda: readline.insert_text(draft))
    return True


def clear_draft() -> None:
    """Undo ``offer_draft`` once the prompt has shown it."""
    with contextlib.suppress(ImportError):
        import readline

        readline.set_startup_hook(None)


class WordWrap:
    """Streamed text broken at word boundaries for a terminal ``width`` cells wide.

    A word is held until it is whole (the next space or line end), then goes on this
    line or, when it would cross the edge, on the next; a word wider than the terminal
    is broken where the edge falls. ``feed`` returns what to write now, ``finish`` the
    rest. Widths are terminal cells (``rich.cells.cell_len``: wide characters count 2).
    """

    def __init__(self, width: int) -> None:
        self.width = max(1, width)
        self.column = 0
        self._word = ""

    def _flush(self) -> str:
        word, self._word = self._word, ""
        if not word:
            return ""
        size = cell_len(word)
        out = ""
        if self.column and self.column + size > self.width:
            out, self.column = "\n", 0
        while size > self.width:  # longer than a line: break it at the edge
            head = ""
            for ch in word:
                if cell_len(head + ch) > self.width:
                    break
                head += ch
            out += head + "\n"
            word = word[len(head) :]
            size = cell_len(word)
        self.column += size
        return out + word

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if ch == "\n":
                out.append(self._flush() + "\n")
                self.column = 0
            elif ch.isspace():
                out.append(self._flush())
                if self.column >= self.width:  # the edge: the space becomes the line end
                    out.append("\n")
                    self.column = 0
                else:
                    out.append(ch)
                    self.column += 1
            else:
                self._word += ch
        return "".join(out)

    def finish(self) -> str:
        """The word still held (the reply ended, or was stopped); the next line starts at 0."""
        out = self._flush()
        self.column = 0
        return out
