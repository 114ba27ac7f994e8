"""Layer 5: the ``tokenbelt`` command line."""

from __future__ import annotations

import logging
import sys

from .._errors import TokenbeltError
from ._common import Parser


def build_parser() -> Parser:
    from .. import __version__
    from . import _chat, _demo, _models, _probe, _serve

    parser = Parser(prog="tokenbelt", description="A local LLM runtime whose Stop really stops.")
    parser.add_argument("--version", action="version", version=f"tokenbelt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    _demo.add_parser(sub)
    _serve.add_parser(sub)
    _chat.add_parser(sub)
    _models.add_parser(sub)
    _probe.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokenbelt`` console script."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except TokenbeltError as exc:
        print(f"tokenbelt: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokenbelt: interrupted", file=sys.stderr)
        return 130
    return status
