"""The chat's line parsing and the cleaning of keys typed during a reply."""

from __future__ import annotations

import os

import pytest

from tokenbelt.cli._terminal import Command, QuietKeys, WordWrap, clean_typed


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


def wrapped(pieces: list[str], width: int) -> list[str]:
    wrap = WordWrap(width)
    return ("".join(wrap.feed(p) for p in pieces) + wrap.finish()).split("\n")


def test_streamed_words_break_at_word_boundaries_at_the_edge() -> None:
    text = "The lighthouse keeper climbed the spiral stairs every evening at dusk."
    # Pieces that cut words, as tokens do.
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    lines = wrapped(pieces, 20)
    assert all(len(line) <= 20 for line in lines), lines
    assert " ".join(line.strip() for line in lines) == text  # no word was cut
    assert lines == [
        "The lighthouse ",
        "keeper climbed the ",
        "spiral stairs every ",
        "evening at dusk.",
    ]


def test_a_word_wider_than_the_terminal_breaks_at_the_edge_and_newlines_reset() -> None:
    assert wrapped(["abcdefghij", "klm no"], 4) == ["abcd", "efgh", "ijkl", "m no"]
    assert wrapped(["one\ntwo three"], 8) == ["one", "two ", "three"]
    assert wrapped(["日本語の文"], 4) == ["日本", "語の", "文"]  # wide characters: 2 cells
