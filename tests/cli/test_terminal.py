"""The chat's line parsing and the cleaning of keys typed during a reply."""

from __future__ import annotations

import os

import pytest

from tokenbelt.cli._terminal import Command, QuietKeys, clean_typed


@pytest.mark.parametrize(
    ("line", "name", "arg"),
    [
        ("hello", None, "hello"),
        ("  /help ", "/help", ""),
        ("/SYSTEM Be brief.", "/system", "Be brief."),
        ("/model  other ", "/model", "other"),
        ("exit", "/exit", ""),
        ("QUIT", "/exit", ""),
        ("/quit", "/exit", ""),
        ("//etc/hosts is a file", None, "/etc/hosts is a file"),
        ("exit the loop, please", None, "exit the loop, please"),
    ],
)
def test_commands_and_messages(line: str, name: str | None, arg: str) -> None:
    assert Command.parse(line) == Command(name, arg)


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"and now\r", "and now"),
        (b"tpyo\x7f\x7f\x7fypo", "typo"),
        (b"line one\nline two\n", "line one line two"),
        (b"gone\x15kept", "kept"),
        (b"up\x1b[A\x1b[Bdown\x1bOP\x1b[3~", "updown"),
        ("caf\u00e9".encode(), "caf\u00e9"),
        (b"", ""),
    ],
)
def test_typed_keys_become_one_line_of_text(raw: bytes, text: str) -> None:
    assert clean_typed(raw) == text


def test_outside_a_terminal_keys_are_left_alone() -> None:
    read, write = os.pipe()
    try:
        os.write(write, b"typed\n")
        keys = QuietKeys(read)
        with keys.held():
            pass
        assert keys.take_draft() == ""
        assert os.read(read, 100) == b"typed\n", "a pipe's input is not drained"
    finally:
        os.close(read)
        os.close(write)
