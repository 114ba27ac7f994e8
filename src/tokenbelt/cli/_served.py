"""Which models ``tokenbelt serve`` serves, and each one's own settings.

``serve A B C`` serves three aliases: ``A`` loads at start, ``B`` and ``C`` on their first
request. ``--all-models`` adds every catalog alias whose file is on this machine (as
Ollama serves what it has pulled: a model still to download is not served until
``tokenbelt models pull``). ``--pin A`` keeps ``A`` loaded whatever the memory budget
needs; ``--model A:slots=2,n_ctx=2048,keep_alive=60`` gives ``A`` its own settings.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from ._common import counted, keep_alive_seconds, n_ctx

#: the settings ``--model ALIAS:KEY=VALUE,...`` may give, and how each is read
_KEYS = {"slots": counted("slots"), "n_ctx": n_ctx, "keep_alive": keep_alive_seconds}


@dataclass(frozen=True)
class ModelSettings:
    """One ``--model`` flag: an alias and the settings it gives it."""

    alias: str
    options: dict[str, Any] = field(default_factory=dict)


def model_settings(text: str) -> ModelSettings:
    """An argparse type for ``ALIAS:KEY=VALUE[,KEY=VALUE...]``."""
    alias, sep, rest = text.partition(":")
    if not sep or not alias or not rest:
        raise argparse.ArgumentTypeError(
            f"give ALIAS:KEY=VALUE[,KEY=VALUE...] (keys: {', '.join(_KEYS)}), got {text!r}"
        )
    options: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if key not in _KEYS or not eq:
            raise argparse.ArgumentTypeError(
                f"{alias}: {item!r} is not KEY=VALUE with a key of {', '.join(_KEYS)}"
            )
        try:
            parsed = _KEYS[key](value.strip())
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{alias}: {key}: {exc}") from None
        # keep_alive 0 on the command line is "never unload", as --keep-alive 0 is.
        options[key] = (parsed or None) if key == "keep_alive" else parsed
    return ModelSettings(alias, options)


def cached_aliases() -> list[str]:
    """The catalog's aliases whose file for this machine is on disk (``--all-models``)."""
    from .._errors import TokenbeltError
    from ..models import Catalog, Home, ModelCache, choose_variant

    home = Home.from_env()
    catalog, cache = Catalog.load(home), ModelCache(home)
    found = []
    for entry in catalog:
        try:
            choice = choose_variant(catalog, entry.alias, cache=cache)
        except TokenbeltError:  # no variant this machine runs: not served
            continue
        if cache.is_cached(choice.variant):
            found.append(entry.alias)
    return found


def served_aliases(args: argparse.Namespace, default: str) -> list[str]:
    """The aliases to serve, first the one loaded at start; exits on a bad combination."""
    from ._common import fail

    aliases = list(dict.fromkeys(args.alias))
    if args.all_models:
        aliases += [a for a in cached_aliases() if a not in aliases]
    if not aliases and not args.upstream:
        aliases = [default]
    named = {s.alias for s in args.model}
    for alias in sorted((named | set(args.pin)) - set(aliases)):
        fail(f"--pin and --model name {alias!r}, which is not served: add it to the aliases", 2)
    return aliases


def options_for(alias: str, args: argparse.Namespace) -> dict[str, Any]:
    """``Runtime.load`` keywords for ``alias``: its ``--model`` settings and ``--pin``."""
    options: dict[str, Any] = {}
    for given in args.model:
        if given.alias == alias:
            options.update(given.options)
    if alias in args.pin:
        options["pin"] = True
    return options
