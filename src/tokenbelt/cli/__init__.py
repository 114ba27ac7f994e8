"""Layer 5: the ``tokenbelt`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from .._errors import TokenbeltError
from ._common import Parser


def build_parser() -> Parser:
    from .. import __version__
    from . import _chat, _demo, _models, _probe, _ps, _serve, _transcribe

    parser = Parser(prog="tokenbelt", description="A local LLM runtime whose Stop really stops.")
    parser.add_argument("--version", action="version", version=f"tokenbelt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    _demo.add_parser(sub)
    _serve.add_parser(sub)
    _chat.add_parser(sub)
    _models.add_parser(sub)
    _probe.add_parser(sub)
    _ps.add_parser(sub)
    _transcribe.add_parser(sub)
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command's own parser that ``args`` were parsed for, the deepest one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _chosen(chosen, args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokenbelt`` console script."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command it was given to: ``tokenbelt serve: error: ...``
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        status: int = args.func(args)
    except TokenbeltError as exc:
        print(f"tokenbelt: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokenbelt: interrupted", file=sys.stderr)
        return 130
    return status
