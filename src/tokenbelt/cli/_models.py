"""``tokenbelt models list | pull | verify | rm | add``: the catalog and the download cache."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._errors import DownloadCancelled, IntegrityError
from ..models import (
    DEVICES,
    HF_SCHEME,
    Catalog,
    DownloadTimeouts,
    Home,
    ModelCache,
    ModelEntry,
    Variant,
    add_model,
    detect_device,
    forget_model,
    pull_from_hub,
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
            "kind": entry.kind,
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

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=200)  # a pipe or a file: no need to squeeze into 80 columns
    # The alias is what people type: never cut it. Narrow screens lose the least useful
    # columns first; the other cells wrap rather than end in an ellipsis.
    columns = ["alias", "kind", "variant", "device", "quant", "size", "source", "state"]
    if console.width < 100:
        columns.remove("source")
    if console.width < 80:
        columns.remove("quant")
    table = Table(title=f"models (devices here: {', '.join(info.devices)})")
    longest = max((len(r["alias"]) for r in rows + remotes), default=5)
    for column in columns:
        if column == "alias":
            table.add_column(column, no_wrap=True, min_width=longest)
        else:
            table.add_column(
                column, overflow="fold", justify="right" if column == "size" else "left"
            )
    for r in rows:
        cells = {
            "alias": r["alias"],
            "kind": r["kind"],
            "variant": r["variant"],
            "device": r["device"] if r["runnable"] else f"{r['device']} (not here)",
            "quant": r["quantization"] or "-",
            "size": _size(r["size"]),
            "source": r["source"],
            "state": r["state"],
        }
        table.add_row(*(cells[c] for c in columns))
    for e in remotes:
        urls = e["url"] if isinstance(e["url"], list) else [e["url"]]
        cells = {
            "alias": e["alias"],
            "kind": "chat",
            "variant": e["model"],
            "device": "remote",
            "quant": "-",
            "size": "-",
            "source": ", ".join(urls),
            "state": "remote",
        }
        table.add_row(*(cells[c] for c in columns))
    console.print(table)
    console.print(f"[dim]{info.reason}[/dim]")
    if any(r["state"] == "corrupt" for r in rows):
        console.print("[dim]corrupt: `tokenbelt models verify ALIAS` says how to fix it[/dim]")
    return 0


@contextmanager
def _progress_bar(label: str) -> Iterator[Any]:
    """A rich progress bar on stderr (a terminal), shown once the first bytes arrive."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,  # a log file gets the outcome, not a bar's frames
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
    hub = args.alias.startswith(HF_SCHEME)
    if not hub and (args.revision or args.as_alias or args.replace or args.force):
        _err(
            "error: --revision, --alias, --replace and --force are for hf:// pulls; "
            f"{args.alias} is already in the catalog"
        )
        return 2

    def waiting() -> None:
        _err(f"waiting for another process that is downloading {args.alias}")

    with _progress_bar(args.alias) as progress:
        try:
            if hub:
                pulled = pull_from_hub(
                    args.alias,
                    revision=args.revision or "main",
                    alias=args.as_alias,
                    device=args.device or "cpu",
                    replace=args.replace,
                    force=args.force,
                    progress=progress,
                    timeouts=timeouts,
                    on_wait=waiting,
                )
            else:
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
                f"file: run the same `tokenbelt models pull` again to resume"
            )
            return 130
    if hub:
        entry = pulled.entry
        v = entry.variants[0]
        print(
            f"added {entry.alias} ({entry.architecture}, context {entry.context_length}, "
            f"{v.quantization or 'unknown quantisation'}, {_size(v.size)}, sha256 checked) "
            f"from {pulled.hub.uri} at commit {pulled.hub.commit[:12]}: {pulled.path}"
        )
        print(f"run it with `tokenbelt chat {entry.alias}` or `tokenbelt serve {entry.alias}`")
        return 0
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
    entry = catalog.get(args.alias)
    removed = []
    for v in _variants(catalog, args.alias):
        removed += cache.remove(v)
    for p in removed:
        print(f"removed {p}")
    if args.forget:
        forgotten = forget_model(args.alias, home=home)
        print(f"forgot {forgotten.alias} (a file you added with `models add` stays where it is)")
        if forgotten.alias in Catalog.load(home):
            print(f"{forgotten.alias} is the model that comes with tokenbelt again")
        return 0
    if removed:
        return 0
    print(f"nothing to remove for {args.alias}: {_why_nothing(entry, cache)}")
    return 0


def _why_nothing(entry: ModelEntry, cache: ModelCache) -> str:
    """Why ``rm`` found no file of tokenbelt's own to delete, and what to do instead."""
    added = entry.origin == cache.home.catalog_file
    kinds = {v.source.kind for v in entry.variants}
    if kinds == {"path"}:
        files = ", ".join(str(v.source.describe()) for v in entry.variants)
        return (
            f"its file is yours ({files}) and tokenbelt never deletes it; "
            f"`tokenbelt models rm --forget {entry.alias}` drops the alias"
        )
    if kinds == {"distribution"}:
        return "its file comes inside an installed package (pip uninstall removes it)"
    hint = f"; `tokenbelt models rm --forget {entry.alias}` drops the alias" if added else ""
    return f"no file of it was downloaded{hint}"


def _add(args: argparse.Namespace) -> int:
    entry = add_model(
        args.path, args.alias, device=args.device, replace=args.replace, force=args.force
    )
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

    c = cmds.add_parser(
        "pull",
        help="download (if needed) and verify a model, or add one from Hugging Face",
        description="Download and verify a catalog model, or pull hf://ORG/REPO/FILE.gguf: "
        "its size and sha256 come from the Hub, the download resumes if interrupted, and "
        "the file is added to your catalog under an alias (by default from the file name).",
    )
    c.add_argument(
        "alias", metavar="ALIAS", help="an alias, a full variant id, or hf://ORG/REPO/FILE.gguf"
    )
    c.add_argument(
        "--device",
        choices=DEVICES,
        help="pick the variant for this device (hf://: the device it is for, default cpu)",
    )
    c.add_argument(
        "--revision", metavar="R", help="hf:// only: branch, tag or commit (default main)"
    )
    c.add_argument(
        "--alias",
        dest="as_alias",
        metavar="NAME",
        help="hf:// only: the alias to add (default: from the file name)",
    )
    c.add_argument("--replace", action="store_true", help="hf:// only: replace an existing alias")
    c.add_argument(
        "--force", action="store_true", help="with --replace: also replace a shipped alias"
    )
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
    c.add_argument(
        "--force", action="store_true", help="with --replace: also replace a shipped alias"
    )
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
