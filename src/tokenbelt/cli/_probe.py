"""``tokenbelt probe [ALIAS]``: one model's whole life on this machine, measured."""

from __future__ import annotations

import argparse
import json
import sys

from ..models import DEFAULT_ALIAS, DEVICES, ProbeReport, run_probe
from ._common import Parser, add_isolation_options, positive_duration, thread_count

_ROWS = (
    ("device", "device", ""),
    ("device_reason", "why", ""),
    ("variant", "variant", ""),
    ("model_path", "file", ""),
    ("verified", "verified", ""),
    ("load_s", "load", "s"),
    ("ttft_ms", "time to first token", "ms"),
    ("decode_tok_s", "decode", "tok/s"),
    ("threads", "threads used for decode", ""),
    ("reply", "reply", ""),
    ("draft_off_tok_s", "copying reply, drafting off", "tok/s"),
    ("draft_tok_s", "copying reply, drafting left to decide", "tok/s"),
    ("draft_decision", "drafting decided", ""),
    ("draft_pays", "drafting pays here", ""),
    ("draft_row_costs", "a step of n tokens over one", ""),
    ("prefill_prompt_tokens", "prefill prompt", "tokens"),
    ("cancel_release_prefill_ms", "cancel in prefill -> released", "ms"),
    ("cancel_release_decode_ms", "cancel in decode -> released", "ms"),
    ("rss_loaded_mb", "RSS loaded", "MiB"),
    ("unload_rss_returned_mb", "RSS returned by unload", "MiB"),
    ("unload_rss_residual_mb", "RSS kept after unload", "MiB"),
    ("worker_rss_loaded_mb", "worker RSS loaded", "MiB"),
    ("worker_rss_after_unload_mb", "worker RSS after unload", "MiB"),
)


def _print_report(report: ProbeReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokenbelt probe: {report.alias}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    data = report.to_dict()
    for key, label, unit in _ROWS:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{n}: {cost}x" for n, cost in value.items()) or "none timed"
        table.add_row(label, f"{value} {unit}".strip())
    if report.cancel_prefill_landed == "decode":
        table.add_row("note", "the prefill finished before the cancel; it landed in decode")
    status = "[green]ok[/green]" if report.ok else f"[red]failed at {report.failed_step}[/red]"
    table.add_row("result", status)
    Console().print(table)


def main(args: argparse.Namespace) -> int:
    report = run_probe(
        args.alias,
        device=args.device,
        load_timeout=args.load_timeout,
        n_threads=args.threads,
        n_threads_batch=args.threads_batch,
        isolation=args.isolation,
    )
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _print_report(report)
    if not report.ok:
        print(
            f"tokenbelt: error: probe failed at step {report.failed_step!r}: {report.error}; "
            f"what to do: {report.hint}",
            file=sys.stderr,
        )
        return 1
    return 0


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "probe",
        help="run a model's whole life here and measure it (resolve to unload)",
        description="Resolve, verify, load, stream, cancel in prefill and decode, unload.",
    )
    p.add_argument(
        "alias",
        metavar="ALIAS",
        nargs="?",
        default=DEFAULT_ALIAS,
        help=f"an alias or a variant id (default {DEFAULT_ALIAS})",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        help="pick the variant for this device (default: the best this machine runs)",
    )
    p.add_argument(
        "--load-timeout",
        type=positive_duration,
        default=120.0,
        metavar="S",
        help="seconds the load may take (default 120)",
    )
    p.add_argument(
        "--threads", type=thread_count, help="llama.cpp decode threads (default: adaptive)"
    )
    p.add_argument(
        "--threads-batch", type=thread_count, help="llama.cpp prompt threads (default: adaptive)"
    )
    add_isolation_options(p, grace=False)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=main)
