"""What kind of server an upstream is, found by a probe, and what that kind can do: which
sampling options it takes (the rest are refused, naming the upstream) and how a front can
stop a request there and confirm that it stopped.

- **tokenbelt**: top_k, min_p, repeat_penalty, repeat_last_n, ignore_eos, min_tokens. Stop:
  its cancel endpoint, then the close. Confirmed by its own trace of the request (same id).
- **vLLM**: top_k, min_p, repeat_penalty (its ``repetition_penalty``), ignore_eos,
  min_tokens. Stop: the close (vLLM aborts a request whose client left), and
  ``/inference/v1/abort_requests`` where it is served (``--enable-scale-out``); it takes the
  front's ``x-request-id`` into its own id. Confirmed by ``/metrics``: its running and
  waiting requests fell to those the front still has there.
- **llama.cpp's server**: top_k, min_p, repeat_penalty, repeat_last_n, ignore_eos. Stop: the
  close. Confirmed by ``/slots``: its busy slots fell to those the front still has there.
- **llama-cpp-python's server**: top_k, min_p, repeat_penalty, min_tokens. Stop: the close.
  Unconfirmed: it keeps no record a front can read.
- **Ollama**: none beyond OpenAI's (its OpenAI route reads no others). Stop: the close.
  Unconfirmed: ``/api/ps`` lists models, not requests.
- A grammar (``response_format``'s JSON schema, tool calls with ``tool_choice`` required
  or named) goes to vLLM (``structured_outputs.grammar``) and llama.cpp's servers
  (``grammar``); tokenbelt, Ollama and others are refused it, as is a grammar that starts
  at a trigger (``tool_choice: auto``) anywhere.
- **other**: top_k, min_p, repeat_penalty (sent as always; such servers ignore fields
  they do not know). Unconfirmed.

The probe (``GET /v1/models``, then ``/version`` and ``/openapi.json``, ``/slots`` and
``/props`` (its ``build_info``: the version), or ``/api/version`` as the first answer
suggests) runs when the engine starts and again at a
health check while it has not succeeded.
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

#: options every kind takes: OpenAI's own
OPENAI = frozenset({"max_tokens", "temperature", "top_p", "seed", "stop"})
_EXTRA_COMMON = frozenset({"top_k", "min_p", "repeat_penalty"})


class Kind(enum.Enum):
    """The server behind an upstream URL."""

    #: another tokenbelt (its models carry a ``tokenbelt`` extension)
    TOKENBELT = "tokenbelt"
    #: vLLM's OpenAI server (``owned_by: vllm``, ``/version``)
    VLLM = "vllm"
    #: llama.cpp's ``llama-server`` (``owned_by: llamacpp``)
    LLAMA_SERVER = "llama-server"
    #: llama-cpp-python's ``llama_cpp.server`` (``owned_by: me``)
    LLAMA_CPP_PYTHON = "llama-cpp-python"
    #: Ollama's OpenAI route (``/api/version``)
    OLLAMA = "ollama"
    #: any other OpenAI-compatible server, or one not probed yet
    OTHER = "openai-compatible"


#: the sampling options (``SamplingParams`` fields) each kind takes beyond OpenAI's
OPTIONS: Mapping[Kind, frozenset[str]] = {
    Kind.TOKENBELT: _EXTRA_COMMON | {"repeat_last_n", "ignore_eos", "min_tokens"},
    Kind.VLLM: _EXTRA_COMMON | {"ignore_eos", "min_tokens"},
    Kind.LLAMA_SERVER: _EXTRA_COMMON | {"repeat_last_n", "ignore_eos"},
    Kind.LLAMA_CPP_PYTHON: _EXTRA_COMMON | {"min_tokens"},
    Kind.OLLAMA: frozenset(),
    Kind.OTHER: _EXTRA_COMMON,
}

#: an option's name on the wire where the kind spells it otherwise
WIRE_NAMES: Mapping[Kind, Mapping[str, str]] = {
    Kind.VLLM: {"repeat_penalty": "repetition_penalty"},
}

#: where each kind takes a GBNF grammar (a JSON schema's, tool calls'): vLLM's xgrammar reads
#: llama.cpp's GBNF in ``structured_outputs.grammar``; llama.cpp's servers in ``grammar``.
#: None takes one that starts at a trigger (``tool_choice: auto``).
GRAMMAR: Mapping[Kind, str] = {
    Kind.VLLM: "structured_outputs",
    Kind.LLAMA_SERVER: "grammar",
    Kind.LLAMA_CPP_PYTHON: "grammar",
}

#: why a stop at each kind cannot be confirmed, where it cannot
UNCONFIRMABLE: Mapping[Kind, str] = {
    Kind.LLAMA_CPP_PYTHON: "llama-cpp-python's server keeps no record a front can read",
    Kind.OLLAMA: "Ollama has no per-request status and no count of running requests",
    Kind.OTHER: "an upstream of unknown kind: nothing to read its release from",
}


@dataclass(frozen=True)
class Probed:
    """What the probe found: the kind, its version, and what it enables."""

    kind: Kind = Kind.OTHER
    version: str | None = None
    #: vLLM: ``/inference/v1/abort_requests`` is served (``--enable-scale-out``)
    abort_route: bool = False
    #: llama.cpp's server: ``/slots`` answers (not started with ``--no-slots``)
    slots: bool = False
    #: True once a probe got an answer (an upstream down at start is probed again)
    done: bool = False

    def options(self) -> frozenset[str]:
        return OPTIONS[self.kind]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value}
        if self.version:
            out["version"] = self.version
        return out


async def _get(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]
) -> tuple[int, Any]:
    """(status, JSON body or None) of a GET; (0, None) when it cannot be made."""
    import aiohttp

    try:
        async with session.get(
            url,
            headers={**headers, "connection": "close"},
            timeout=aiohttp.ClientTimeout(total=2.0),
        ) as answer:
            body = await answer.read()
            status = answer.status
    except (aiohttp.ClientError, TimeoutError):
        return 0, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


async def probe(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str], *, tokenbelt: bool
) -> Probed:
    """Ask ``url`` what it is (on the engine's loop; a few small GETs)."""
    if tokenbelt:
        return Probed(Kind.TOKENBELT, done=True)
    status, listed = await _get(session, f"{url}/v1/models", headers)
    if status != 200 or not isinstance(listed, dict):
        return Probed()
    entries = [e for e in listed.get("data") or () if isinstance(e, dict)]
    if any(isinstance(e.get("tokenbelt"), dict) for e in entries):
        return Probed(Kind.TOKENBELT, done=True)
    owners = {e.get("owned_by") for e in entries}
    if "vllm" in owners:
        return await _vllm(session, url, headers)
    if "llamacpp" in owners:
        return await _llama_server(session, url, headers)
    if "me" in owners:
        return Probed(Kind.LLAMA_CPP_PYTHON, done=True)
    status, version = await _get(session, f"{url}/api/version", headers)
    if status == 200 and isinstance(version, dict) and "version" in version:
        return Probed(Kind.OLLAMA, str(version["version"]), done=True)
    return Probed(done=True)


async def _vllm(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> Probed:
    _, version = await _get(session, f"{url}/version", headers)
    _, api = await _get(session, f"{url}/openapi.json", headers)
    paths = api.get("paths", {}) if isinstance(api, dict) else {}
    number = str(version["version"]) if isinstance(version, dict) and "version" in version else None
    return Probed(Kind.VLLM, number, abort_route="/inference/v1/abort_requests" in paths, done=True)


async def _llama_server(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]
) -> Probed:
    status, slots = await _get(session, f"{url}/slots", headers)
    _, props = await _get(session, f"{url}/props", headers)
    build = props.get("build_info") if isinstance(props, dict) else None
    return Probed(
        Kind.LLAMA_SERVER,
        str(build) if build else None,
        slots=status == 200 and isinstance(slots, list),
        done=True,
    )


def metric(text: str, name: str) -> float | None:
    """The sum of every series of the Prometheus metric ``name`` in ``text`` (None: absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
    return total if seen else None
