"""``tokenbelt models list | pull | verify | rm | add``: the catalog and the download cache."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._errors import DownloadCancelled, IntegrityError
from ..models import (
    DEVICES,
    Catalog,
    DownloadTimeouts,
    Home,
    ModelCache,
    Variant,
    add_model,
    detect_device,
    forget_model,
    remote_entries,
    resolve_and_fetch,
)
from ._common import Parser, positive_duration, positive_int


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _err(message: str) -> None:
    print(f"tokenbelt: {message}", file=sys.stderr, flush=True)


def _list(args: argparse.Namespace) -> int:
    home = Home.from_env()
    catalog, cache, info = Catalog.load(home), ModelCache(home), detect_device()
    rows: list[dict[str, Any]] = [
        {
            "alias": entry.alias,
            "variant": v.id,
            "device": v.device,
            "quantization": v.quantization,
            "size": v.size,
            "source": v.source.kind,
            "state": cache.state(v),
            "runnable": info.can_run(v.device),
        }
        for entry in catalog
        for v in entry.variants
    ]
    remotes = [e.to_json() for e in remote_entries(home).values()]
    if args.json:
        print(
            json.dumps(
                {
                    "devices": list(info.devices),
                    "device_reason": info.reason,
                    "models": rows,
                    "remote": remotes,
                }
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"models (devices here: {', '.join(info.devices)})")
    for column in ("alias", "variant", "device", "quant", "size", "source", "state"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for r in rows:
        device = r["device"] if r["runnable"] else f"{r['device']} (not here)"
        table.add_row(
            r["alias"],
            r["variant"],
            device,
            r["quantization"] or "-",
            _size(r["size"]),
            r["source"],
            r["state"],
        )
    for e in remotes:
        urls = e["url"] if isinstance(e["url"], list) else [e["url"]]
        table.add_row(e["alias"], e["model"], "remote", "-", "-", ", ".join(urls), "remote")
    console = Console()
    if not console.is_terminal:  # a pipe or a file: no need to squeeze into 80 columns
        console = Console(width=200)
    console.print(table)
    console.print(f"[dim]{info.reason}[/dim]")
    return 0


@contextmanager
def _progress_bar(label: str) -> Iterator[Any]:
    """A rich progress bar on stderr, shown once the first bytes arrive."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    task: list[Any] = []

    def update(received: int, total: int | None) -> None:
        if not task:
            progress.start()
            task.append(progress.add_task(label, total=total, completed=received))
        progress.update(task[0], completed=received, total=total)

    try:
        yield update
    finally:
        if task:
            progress.stop()


def _pull(args: argparse.Namespace) -> int:
    timeouts = DownloadTimeouts(connect=args.connect_timeout, stall=args.stall_timeout)

    def waiting() -> None:
        _err(f"waiting for another process that is downloading {args.alias}")

    with _progress_bar(args.alias) as progress:
        try:
            resolved = resolve_and_fetch(
                args.alias,
                device=args.device,
                progress=progress,
                timeouts=timeouts,
                on_wait=waiting,
            )
        except (KeyboardInterrupt, DownloadCancelled):
            _err(
                f"pull of {args.alias} cancelled; an http(s) download keeps its partial "
                f"file: run `tokenbelt models pull {args.alias}` again to resume"
            )
            return 130
    how = "sha256 checked" if resolved.hashed else "unchanged since its last check"
    print(f"{resolved.variant} ready on {resolved.device}: {resolved.path} ({how})")
    return 0


def _variants(catalog: Catalog, name: str | None) -> list[Variant]:
    if name is None:
        return [v for entry in catalog for v in entry.variants]
    entry, exact = catalog.lookup(name)
    return [exact] if exact is not None else list(entry.variants)


def _verify(args: argparse.Namespace) -> int:
    home = Home.from_env()
    catalog, cache = Catalog.load(home), ModelCache(home)
    bad = checked = 0
    for v in _variants(catalog, args.alias):
        path = cache.local_path(v)
        if path is None:
            if args.alias is not None:
                print(f"absent    {v.id}: not on this machine (tokenbelt models pull {v.id})")
            continue
        checked += 1
        try:
            cache.verify(v, path, force=True)
        except IntegrityError as exc:
            bad += 1
            print(f"CORRUPT   {v.id}: {exc}")
            continue
        print(f"ok        {v.id}: {path}")
    if not checked:
        print("nothing to verify: no model file is on this machine yet")
    if bad:
        _err(f"error: {bad} of {checked} model files failed verification")
        return 1
    return 0


def _rm(args: argparse.Namespace) -> int:
    home = Home.from_env()
    catalog, cache = Catalog.load(home), ModelCache(home)
    removed = []
    for v in _variants(catalog, args.alias):
        removed += cache.remove(v)
    for p in removed:
        print(f"removed {p}")
    if args.forget:
        entry = forget_model(args.alias, home=home)
        print(f"forgot {entry.alias} (its file stays where it is)")
    elif not removed:
        print(f"nothing to remove for {args.alias}: tokenbelt downloaded no file for it")
    return 0


def _add(args: argparse.Namespace) -> int:
    entry = add_model(args.path, args.alias, device=args.device, replace=args.replace)
    v = entry.variants[0]
    print(
        f"added {entry.alias} ({entry.architecture}, context {entry.context_length}, "
        f"{v.quantization or 'unknown quantisation'}, {_size(v.size)}) as {v.id}"
    )
    return 0


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"a header is NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def _add_remote(args: argparse.Namespace) -> int:
    from ..models import RemoteEntry, add_remote

    entry = RemoteEntry(
        alias=args.name,
        urls=tuple(args.url),
        model=args.model,
        api_key_env=args.api_key_env,
        headers=dict(args.header),
        max_concurrency=args.max_concurrency,
    )
    add_remote(entry, replace=args.replace)
    where = ", ".join(entry.urls)
    print(f"added {entry.alias}: {entry.model} at {where}")
    return 0


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "models",
        help="list, pull, verify, remove and add models",
        description="The model catalog and the download cache.",
    )
    cmds = p.add_subparsers(dest="models_command", metavar="ACTION", parser_class=Parser)
    cmds.required = True

    c = cmds.add_parser("list", help="catalog entries, their variants and what is on disk")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=_list)

    c = cmds.add_parser("pull", help="download (if needed) and verify a model")
    c.add_argument("alias", metavar="ALIAS", help="an alias or a full variant id")
    c.add_argument("--device", choices=DEVICES, help="pick the variant for this device")
    c.add_argument(
        "--connect-timeout",
        type=positive_duration,
        default=15.0,
        metavar="S",
        help="seconds to connect (default 15)",
    )
    c.add_argument(
        "--stall-timeout",
        type=positive_duration,
        default=30.0,
        metavar="S",
        help="seconds without data before giving up (default 30)",
    )
    c.set_defaults(func=_pull)

    c = cmds.add_parser("verify", help="re-hash model files on disk (all, or one alias)")
    c.add_argument("alias", metavar="ALIAS", nargs="?", help="an alias or a variant id")
    c.set_defaults(func=_verify)

    c = cmds.add_parser("rm", help="delete the files tokenbelt downloaded for a model")
    c.add_argument("alias", metavar="ALIAS", help="an alias or a variant id")
    c.add_argument(
        "--forget",
        action="store_true",
        help="also drop an alias added with `models add` (its file is kept)",
    )
    c.set_defaults(func=_rm)

    c = cmds.add_parser("add", help="register a local GGUF file under an alias")
    c.add_argument("path", metavar="PATH", help="a .gguf file")
    c.add_argument("--alias", required=True, help="the name to use for it")
    c.add_argument("--device", choices=DEVICES, default="cpu", help="its device (default cpu)")
    c.add_argument("--replace", action="store_true", help="replace an existing alias")
    c.set_defaults(func=_add)

    c = cmds.add_parser(
        "add-remote", help="register a model served by OpenAI-compatible servers (vLLM...)"
    )
    c.add_argument("name", metavar="NAME", help="the name to use for it")
    c.add_argument(
        "--url", action="append", required=True, help="an upstream base URL (repeatable)"
    )
    c.add_argument("--model", required=True, help="the model's name on the upstream")
    c.add_argument("--api-key-env", metavar="VAR", help="environment variable with its API key")
    c.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="an extra header for every request (repeatable)",
    )
    c.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=4,
        help="requests each upstream may hold at once (default 4)",
    )
    c.add_argument("--replace", action="store_true", help="replace an existing alias")
    c.set_defaults(func=_add_remote)
