"""Shared pieces of the command line: a parser whose errors are one line, value types."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from .._errors import InvalidArgument
from ..belt import check_capacity, check_duration

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reports a bad flag in one line and exits with 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _convert(text: str, parse: Callable[[str], T]) -> T:
    try:
        return parse(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _non_negative(value: int) -> int:
    if value < 0:
        raise InvalidArgument(f"value must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (capacities, slots, limits)."""
    return _convert(text, lambda t: check_capacity(int(t), name="value"))


def non_negative_int(text: str) -> int:
    return _convert(text, lambda t: _non_negative(int(t)))


def duration(text: str) -> float:
    """A finite number >= 0 (seconds or milliseconds, as the flag says)."""
    return _convert(text, lambda t: check_duration("value", float(t)) or 0.0)


def positive_duration(text: str) -> float:
    """A finite number > 0."""
    return _convert(text, lambda t: check_duration("value", float(t), allow_zero=False) or 0.0)


def fail(message: str, status: int = 1) -> NoReturn:
    """Print a one-line error to stderr and exit."""
    print(f"tokenbelt: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def thread_count(text: str) -> int:
    """A llama.cpp thread count: an integer from 1 to 4x this machine's CPUs."""
    from ..engines._threads import check_threads

    return _convert(text, lambda t: check_threads("value", int(t)) or 1)


def add_thread_options(p: argparse.ArgumentParser) -> None:
    """``--threads``, ``--threads-batch`` and ``--prefill-chunk``, shared by the commands
    that load a model."""
    p.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="llama.cpp decode threads (default: every core this process may use)",
    )
    p.add_argument(
        "--threads-batch",
        type=thread_count,
        default=None,
        help="llama.cpp prompt threads (default: every core this process may use)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=128,
        help="most prompt tokens per batched step while others decode (default 128)",
    )
