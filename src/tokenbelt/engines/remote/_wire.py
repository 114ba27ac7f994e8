"""The OpenAI wire format, as the remote engine speaks it: request bodies, event streams,
error bodies."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from ..._errors import UpstreamError, UpstreamUnavailable
from .._request import GenerationRequest, SamplingParams
from ._kinds import GRAMMAR, OPTIONS, WIRE_NAMES, Kind

if TYPE_CHECKING:
    import aiohttp  # imported on first use (see ``_engine.py``)

#: options sent whatever their value, where the upstream takes them (as they always were)
ALWAYS_SENT = frozenset({"top_k", "min_p", "repeat_penalty"})
#: the longest event line an upstream may send (a longer one is an error)
MAX_EVENT_BYTES = 256 * 1024
#: the most an error body from an upstream is read
ERROR_BODY_BYTES = 16 * 1024
#: aiohttp's read buffer per connection; it pauses the socket at twice this
READ_BUFFER_BYTES = 64 * 1024


def estimate_tokens(text: str) -> int:
    """A rough token count (4 characters a token) for when the upstream gives no usage."""
    return math.ceil(len(text) / 4)


def error_message(body: object) -> str:
    """The message of an OpenAI-shaped error body (or the body itself, shortened)."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    text = body if isinstance(body, str) else json.dumps(body)
    return text[:500]


async def event_data(response: aiohttp.ClientResponse) -> AsyncGenerator[str, None]:
    """The ``data:`` payloads of an event stream, one network read at a time.

    Little is read ahead of the caller: while it waits (for room on the belt), aiohttp
    stops reading the socket once its buffer holds ``READ_BUFFER_BYTES`` twice over, and
    TCP pushes back on the upstream.
    """
    buf = bytearray()
    async for chunk in response.content.iter_any():
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = bytes(buf[start:end]).rstrip(b"\r")
            start = end + 1
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8", "replace")
        del buf[:start]
        if len(buf) > MAX_EVENT_BYTES:
            raise UpstreamError(f"an event line longer than {MAX_EVENT_BYTES} bytes")


def request_body(request: GenerationRequest, model: str, kind: Kind = Kind.OTHER) -> dict[str, Any]:
    """A streaming request with usage, whatever the client asked (a stream can be stopped).

    Beyond OpenAI's options, those that ``kind`` takes go along (``_kinds.OPTIONS``, under
    the kind's own names): ``top_k``, ``min_p`` and ``repeat_penalty`` always, the others
    when they ask for something (``ignore_eos``, ``min_tokens``, ``repeat_last_n``). An
    option the kind does not take is refused before (``RemoteEngine.count_prompt_tokens``).
    """
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
    }
    names = WIRE_NAMES.get(kind, {})
    for name in OPTIONS[kind]:
        value = getattr(s, name)
        if name in ALWAYS_SENT or value != SamplingParams.__dataclass_fields__[name].default:
            body[names.get(name, name)] = value
    if request.grammar is not None and kind in GRAMMAR:
        g = request.grammar
        gbnf = g.gbnf if g.root == "root" else f"root ::= {g.root}\n{g.gbnf}"
        body[GRAMMAR[kind]] = {"grammar": gbnf} if kind is Kind.VLLM else gbnf
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    if request.messages is not None:
        body["messages"] = [dict(m) for m in request.messages]
    elif request.prompt_tokens is not None:
        body["prompt"] = list(request.prompt_tokens)  # OpenAI's completions take token ids
    else:
        body["prompt"] = request.prompt
    return body


async def raise_for_status(response: aiohttp.ClientResponse, url: str) -> None:
    """Raise the upstream's error answer as ``UpstreamError`` (5xx: ``UpstreamUnavailable``)."""
    data = bytearray()
    async for chunk in response.content.iter_any():
        data += chunk
        if len(data) >= ERROR_BODY_BYTES:
            break
    text = data.decode("utf-8", "replace")
    try:
        message = error_message(json.loads(text))
    except ValueError:
        message = text[:500]
    status = response.status
    if not message:
        message = f"upstream {url} answered {status} {response.reason or ''}".rstrip()
    if status >= 500:
        raise UpstreamUnavailable(f"upstream {url} answered {status}: {message}", status=status)
    raise UpstreamError(message, status=status)
