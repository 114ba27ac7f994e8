"""``tokenbelt ps``: the models a running ``tokenbelt serve`` serves, and where each stands.

One ``GET /health``: for each model its state (and why it is not loaded), the memory it
takes (weights, KV cache, prefix cache; the worker's resident set once measured), its
slots and requests, its pin and when its keep-alive unloads it; then the memory budget.
One ``GET /v1/requests``: the prompts being read now, and how far each has come (a
long prompt's prefill is a busy server, not a hung one). A line per model that served
code completions: how many, how many went stale (superseded), the tokens computed after
they went stale, and keystroke to first token.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ._common import Parser, fail

DEFAULT_URL = "http://127.0.0.1:8080"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f} MiB"


def reading(traces: list[dict[str, Any]]) -> dict[str, str]:
    """Per model, the prompts being read now: ``read/total tok`` (several: summed)."""
    read: dict[str, list[int]] = {}
    for t in traces:
        at = t.get("timeline_ms") or {}
        if at.get("admitted") is None or at.get("first_token") is not None:
            continue
        if at.get("released") is not None or not t.get("prompt_tokens"):
            continue
        done = read.setdefault(t.get("model") or "", [0, 0])
        done[0] += t.get("prompt_read", 0)
        done[1] += t["prompt_tokens"]
    return {model: f"{n}/{total} tok" for model, (n, total) in read.items()}


def _row(status: dict[str, Any], prefill: dict[str, str]) -> list[str]:
    memory = status.get("memory") or {}
    parts = "-"
    if memory:
        parts = "/".join(
            _mib(memory[k]).replace(" MiB", "")
            for k in ("weights_bytes", "kv_bytes", "cache_bytes")
        )
    expires = status.get("expires_in_s")
    return [
        status["name"],
        status["state"],
        _mib(memory.get("total_bytes")),
        parts,
        str(status["slots"]),
        f"{status['running']}/{status['queued']}",
        "yes" if status["pinned"] else "",
        "never"
        if status["keep_alive_s"] is None
        else "-"
        if expires is None
        else f"{expires:.0f} s",
        prefill.get(status["name"], ""),
        status.get("unloaded_because") or "",
    ]


def completions_line(status: dict[str, Any]) -> str | None:
    """What a model's code completions cost and how fast they answered (None: it
    served none and superseded nothing)."""
    c = status.get("completions") or {}
    if not c.get("completions") and not c.get("superseded"):
        return None

    def ms(key: str) -> str:
        value = c.get(key)
        return "-" if value is None else f"{value:.0f} ms"

    return (
        f"completions on {status['name']}: {c.get('completions', 0)} served, "
        f"{c.get('superseded', 0)} superseded, {c.get('stale_tokens', 0)} stale tokens; "
        f"keystroke to first token p50 {ms('first_token_p50_ms')}, "
        f"p95 {ms('first_token_p95_ms')}"
    )


_HEADER = ["MODEL", "STATE", "MEMORY", "WEIGHTS/KV/CACHE", "SLOTS", "RUN/QUEUED", "PINNED",
           "UNLOADS IN", "READING PROMPT", "WHY NOT LOADED"]  # fmt: skip


def table(health: dict[str, Any], traces: list[dict[str, Any]] | None = None) -> str:
    """The text ``tokenbelt ps`` prints for a ``/health`` body (and ``/v1/requests``'s
    traces: the prompts being read): the table, the memory, then a line per model that
    served code completions (``completions_line``)."""
    prefill = reading(traces or [])
    statuses = list(health.get("model_status", {}).values())
    rows = [_HEADER] + [_row(s, prefill) for s in statuses]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    memory = health.get("memory") or {}
    budget = memory.get("budget_bytes")
    lines.append(
        f"memory: {_mib(memory.get('used_bytes', 0))} used of "
        f"{'no budget' if budget is None else _mib(budget)}; "
        f"{memory.get('evictions', 0)} evictions"
    )
    lines += [line for s in statuses if (line := completions_line(s)) is not None]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import httpx

    from ._chat_remote import server_root

    root = server_root(args.url)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.get(f"{root}/health", headers=headers, timeout=10.0)
        body = response.json()
        recent = httpx.get(f"{root}/v1/requests", headers=headers, timeout=10.0)
        traces = recent.json().get("data", []) if recent.status_code == 200 else []
    except httpx.HTTPError as exc:
        fail(f"cannot reach {root}: {exc} (is tokenbelt serve running there? give --url)")
    except ValueError:
        fail(f"{root}/health did not answer JSON: is it a tokenbelt serve?")
    if response.status_code == 401 or "model_status" not in body:
        if args.api_key:
            fail(f"{root} did not accept this API key: give the server's own (--api-key)")
        fail(f"{root} keeps model details for key holders: give --api-key (or TOKENBELT_API_KEY)")
    shown = {
        "models": body["model_status"],
        "memory": body.get("memory"),
        "reading": reading(traces),
    }
    print(json.dumps(shown, indent=2) if args.json else table(body, traces))
    return 0


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "ps",
        help="the models a running server serves: state, memory, slots, pins, keep-alive",
        description="Show the models of a running tokenbelt serve and where each stands.",
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TOKENBELT_API_KEY"),
        help="Bearer key of the server (default: $TOKENBELT_API_KEY)",
    )
    p.add_argument("--json", action="store_true", help="print each model's status as JSON")
    p.set_defaults(func=main)
