"""llama.cpp's line rules for an infill, on a fake clock (no model, no server)."""

from __future__ import annotations

from tokenbelt.server.llamacpp._rules import LineRules


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(rules: LineRules, pieces: list[str], clock: Clock | None = None) -> int:
    """Feed pieces (each 10 ms apart on ``clock``); the index of the one that ended it."""
    for i, piece in enumerate(pieces):
        if rules.feed(piece):
            return i
        if clock is not None:
            clock.now += 0.01
    return -1


def test_no_rules_take_everything() -> None:
    rules = LineRules()
    assert feed(rules, ["a\n", "b\n", "c"]) == -1
    assert rules.text == "a\nb\nc"
    assert rules.has_new_line
    assert rules.stopped is None


def test_predict_time_ends_at_the_first_newline_after_it() -> None:
    clock = Clock()
    rules = LineRules(predict_s=0.025, clock=clock)
    # 0 ms "x\n": in time; 30 ms "z": no newline; 40 ms "w\n": over time, a newline.
    assert feed(rules, ["x\n", "y", "y", "z", "w\n", "more"], clock) == 4
    assert rules.text == "x\nyyzw\n"
    assert rules.stopped == "time"


def test_predict_time_without_a_newline_never_ends_it() -> None:
    clock = Clock()
    rules = LineRules(predict_s=0.001, clock=clock)
    assert feed(rules, ["a", "b", "c"], clock) == -1


def test_a_line_indented_less_than_n_indent_ends_the_block_and_is_cut() -> None:
    rules = LineRules(n_indent=4)
    ended = feed(rules, ["return a", "\n", "    x = 1", "\n", "print", "(a)"])
    assert ended == 4
    assert rules.text == "return a\n    x = 1\n"
    assert rules.stopped == "indent"


def test_the_first_line_is_never_checked_and_indented_lines_go_on() -> None:
    rules = LineRules(n_indent=2)
    assert feed(rules, ["x", "\n", "  y", "\n", "  z"]) == -1
    assert rules.text == "x\n  y\n  z"
