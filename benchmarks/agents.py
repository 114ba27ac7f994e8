"""Agent sessions on a default server: time to first token per turn, cold, warm, restarted.

An agent (Codex, Claude Code, Open WebUI's chat) sends the same long head at every turn:
its instructions and tool descriptions, then a history that grows by the last reply and
a tool's output. This replays sessions of that shape, built from the recorded first
requests in ``tests/server/fixtures/`` (their instructions, system prompt and function
tools, spoken over ``/v1/chat/completions``), for ``--turns`` turns against
``tokenbelt serve`` started with no flags but a fresh home (its prefix cache empty, on
disk in that home), then stops the server, starts it again and replays the first turn.

Per turn: the prompt's tokens, how many were read (computed) rather than taken from the
prefix cache, and the time to first token from the request's trace. Each turn from the
second on is compared with a request holding only that turn's new text, computed whole
(``cache_prompt: false``): the time a turn would take if the head cost nothing.

Targets (issue 54): from the second turn on, each turn's time to first token at most
1.2x that of its new text alone; after the restart, the first turn reads at most 10% of
its prompt again.

The Claude Code session keeps as many of its 25 tools as fit the default model's 8,192
tokens (its whole request is about 23,000: ``--n-ctx 32768 --force-n-ctx``, and minutes
of prefill on 2 cores); Codex's keeps its function tools (its ``web_search`` and
``namespace`` tools are not functions).

Run: ``.venv/bin/python benchmarks/agents.py [--sessions codex,claude-code] [--turns N]
[--json]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from _harness import emit, free_port, parse, parser, print_measures, server_process, targets_line

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "server" / "fixtures"
MODEL = "smollm2-135m"
#: the head a Claude-Code-shaped session keeps, in characters of tool schema (about
#: 6,000 tokens with its system prompt, so five turns fit 8,192)
CLAUDE_TOOL_CHARS = 16_000
TURN_TEXT = (
    "The command printed:\n"
    + "\n".join(f"  test_{i:02d} ... ok ({i * 7 % 13} ms)" for i in range(12))
    + "\nWhat next?"
)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))


def _function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def codex_head() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Codex's first turn: its developer and user messages, and its function tools."""
    body = json.loads((FIXTURES / "codex_request.json").read_text())
    body = body.get("body", body)
    messages = [
        {
            "role": "system" if item["role"] == "developer" else item["role"],
            "content": _text(item["content"]),
        }
        for item in body["input"]
        if item.get("type", "message") == "message" and item.get("role") in ("developer", "user")
    ]
    tools = [
        _function(t["name"], t.get("description", ""), t.get("parameters") or {"type": "object"})
        for t in body["tools"]
        if t.get("type") == "function"
    ]
    return messages, tools


def claude_code_head() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Claude Code's first turn: its system prompt and messages, and its tools that fit."""
    body = json.loads((FIXTURES / "claude_code_messages.json").read_text())["body"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(body["system"])}]
    messages += [{"role": m["role"], "content": _text(m["content"])} for m in body["messages"]]
    tools, size = [], 0
    for t in body["tools"]:
        tool = _function(t["name"], t.get("description", ""), t["input_schema"])
        size += len(json.dumps(tool))
        if size > CLAUDE_TOOL_CHARS:
            break
        tools.append(tool)
    return messages, tools


SESSIONS = {"codex": codex_head, "claude-code": claude_code_head}


def _ask(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = client.post(f"{url}/v1/chat/completions", json=body)
    if answer.status_code != 200:
        raise SystemExit(f"the server answered {answer.status_code}: {answer.text[:300]}")
    reply: dict[str, Any] = answer.json()
    return reply


def _turn(reply: dict[str, Any]) -> dict[str, Any]:
    trace = reply["tokenbelt"]["trace"]
    return {
        "prompt_tokens": trace["prompt_tokens"],
        "read_tokens": trace["prompt_tokens"] - trace["cached_tokens"],
        "ttft_ms": trace["time_to_first_token_ms"],
    }


def session(name: str, turns: int) -> dict[str, Any]:
    """One session's turns on a fresh server, then its first turn after a restart."""
    head, tools = SESSIONS[name]()
    base = {"model": MODEL, "max_tokens": 16, "temperature": 0, "tools": tools}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as home:
        port = free_port()
        command = [sys.executable, "-m", "tokenbelt", "serve", MODEL, "--port", str(port)]
        os.environ["TOKENBELT_HOME"] = home  # the server process reads it at its start
        try:
            with (
                server_process(command, port, timeout=300) as url,
                httpx.Client(timeout=900) as client,
            ):
                history: list[dict[str, Any]] = []
                for k in range(turns):
                    reply = _ask(client, url, {**base, "messages": [*head, *history]})
                    row = _turn(reply)
                    said = reply["choices"][0]["message"].get("content") or "(a tool call)"
                    new = [
                        {"role": "assistant", "content": said},
                        {"role": "user", "content": TURN_TEXT},
                    ]
                    if k:
                        alone = _ask(
                            client,
                            url,
                            {
                                **{k: v for k, v in base.items() if k != "tools"},
                                "cache_prompt": False,
                                "messages": [{"role": "user", "content": _fresh(history[-2:])}],
                            },
                        )
                        row["alone_ttft_ms"] = _turn(alone)["ttft_ms"]
                        row["alone_tokens"] = _turn(alone)["prompt_tokens"]
                    rows.append(row)
                    history += new
            with (
                server_process(command, port, timeout=300) as url,
                httpx.Client(timeout=900) as client,
            ):
                again = _turn(_ask(client, url, {**base, "messages": head}))
        finally:
            del os.environ["TOKENBELT_HOME"]
    ratios = [r["ttft_ms"] / r["alone_ttft_ms"] for r in rows[1:] if r.get("alone_ttft_ms")]
    return {
        "turns": rows,
        "warm_over_alone_max": round(max(ratios), 3) if ratios else None,
        "restart": again,
        "restart_read_share": round(again["read_tokens"] / again["prompt_tokens"], 4),
    }


def _fresh(messages: list[dict[str, Any]]) -> str:
    """A turn's new text as one message, made new (no cache holds it)."""
    return f"[{os.urandom(4).hex()}] " + "\n".join(str(m["content"]) for m in messages)


def run(names: list[str], turns: int) -> dict[str, Any]:
    result: dict[str, Any] = {"model": MODEL, "turns": turns, "sessions": {}}
    targets: dict[str, bool] = {}
    for name in names:
        s = session(name, turns)
        result["sessions"][name] = s
        targets[f"{name}: warm turn <= 1.2x its new text alone"] = (
            s["warm_over_alone_max"] is not None and s["warm_over_alone_max"] <= 1.2
        )
        targets[f"{name}: restart reads <= 10%"] = s["restart_read_share"] <= 0.10
    result["targets"] = targets
    return result


def print_table(r: dict[str, Any]) -> None:
    for name, s in r["sessions"].items():
        rows = []
        for k, t in enumerate(s["turns"], 1):
            alone = t.get("alone_ttft_ms")
            rows.append(
                (
                    f"turn {k}: prompt {t['prompt_tokens']}, read {t['read_tokens']}",
                    f"{t['ttft_ms']:.0f} ms",
                    "cold" if k == 1 else f"alone {alone:.0f} ms ({t['ttft_ms'] / alone:.2f}x)",
                )
            )
        again = s["restart"]
        rows.append(
            (
                f"after a restart: prompt {again['prompt_tokens']}, read {again['read_tokens']}",
                f"{again['ttft_ms']:.0f} ms",
                f"read {100 * s['restart_read_share']:.1f}% (<= 10%)",
            )
        )
        print_measures(
            f"{name}-shaped session, {r['turns']} turns (time to first token)", rows, 44, 24
        )
        print()
    print(targets_line(r["targets"]))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sessions", default="codex,claude-code", help="which (codex, claude-code)")
    p.add_argument("--turns", type=int, default=5, help="turns per session (default 5)")
    args = parse(p, argv)
    names = [n for n in args.sessions.split(",") if n]
    unknown = [n for n in names if n not in SESSIONS]
    if unknown:
        p.error(f"unknown session {', '.join(unknown)} (known: {', '.join(SESSIONS)})")
    emit(run(names, args.turns), args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
