"""THE pipe protocol between ``WorkerEngine`` (the parent) and its worker process.

One frozen record per message kind; both ends dispatch on the record's type, so every
field is typed across the process boundary. ``rid`` is the parent's number for a
request (one per ``start``). On the pipe each message is one frame: a pickle, length
prefixed, exactly as ``multiprocessing.connection.Connection`` reads it (``frame``).
What is pickled is the plain tuple ``encode`` makes (the kind's number, then the
fields), which ``decode`` turns back into the record: a pickled dataclass costs about
ten times a tuple, and an ``Item`` crosses the pipe for every token. Each end's reader
waits for a frame in ``input_waiter``.

Parent to worker: ``Load`` (the first message, once), then ``Start``, ``Cancel``,
``Credit``, ``Ping`` (the heartbeat) and ``Close``. Worker to parent: ``Ready`` or
``LoadError`` (once), ``Pong`` (the heartbeat's answer, between two steps), then per
request ``Admit``, ``Prompt``, ``Cached``, ``Read``\\ s (the prefill's progress),
``Item``\\ s (and a thinking model's ``Reasoning`` marks), one end (``Finish``, ``Fail``
or ``Cancel``) and ``Release``.
What one decode step made for all its requests (each one's item, an end, a release)
crosses as one ``Step`` frame: one write, one read and one wake-up of the parent per
step rather than per token (``messages`` unpacks any frame into its messages).

Backpressure is credits: the worker may send as many ``Item``\\ s for a request as the
parent granted (the belt's capacity at ``Start``, then each ``Credit``). Completion
tokens counted since the last message that carried a count ride on the next ``Item``
or end (``tokens``). Items are pickled as they are, whatever the engine puts.
"""

from __future__ import annotations

import operator
import pickle
import select
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from typing import Any, cast

from ...belt import EndReason
from .._request import GenerationRequest
from .._statistics import BatchStatistics
from ..llama import LlamaConfig

# -- parent to worker ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """Load the model file ``path`` with the batch engine's configuration."""

    path: str
    config: LlamaConfig
    #: a test-only crash point for this worker ("prefill", "decode"), or None
    crash_point: str | None


@dataclass(frozen=True, slots=True)
class Start:
    """Start a request; the worker may send ``capacity`` items before the first credit."""

    rid: int
    request_id: str
    request: GenerationRequest
    capacity: int
    #: the prompt as the parent tokenized it (the same vocabulary), or None
    tokens: list[int] | None


@dataclass(frozen=True, slots=True)
class Credit:
    """The parent's reader took ``n`` items: the worker may send ``n`` more."""

    rid: int
    n: int


@dataclass(frozen=True, slots=True)
class Close:
    """Exit: close the engine and the pipe."""


@dataclass(frozen=True, slots=True)
class Ping:
    """The heartbeat: answer ``Pong(n)`` between two steps of the engine's loop."""

    n: int


# -- both ways ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cancel:
    """A request ends for ``reason``: the parent's belt was cancelled (to the worker), or
    the worker's engine ended it for a reason of its own, such as ``shutdown`` (to the
    parent)."""

    rid: int
    reason: EndReason


# -- worker to parent ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The model is loaded; ``info`` describes the engine (pid, slots, threads...)."""

    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LoadError:
    """The model could not be loaded; the worker exits."""

    message: str


@dataclass(frozen=True, slots=True)
class Admit:
    """The worker's loop admitted the request."""

    rid: int


@dataclass(frozen=True, slots=True)
class Prompt:
    """The request's prompt has ``n`` tokens."""

    rid: int
    n: int


@dataclass(frozen=True, slots=True)
class Cached:
    """``n`` prompt tokens came from the prefix cache."""

    rid: int
    n: int


@dataclass(frozen=True, slots=True)
class Read:
    """``n`` of the prompt's tokens are in the KV cache (cached or computed) so far."""

    rid: int
    n: int


@dataclass(frozen=True, slots=True)
class Item:
    """One item for the request's belt, and the tokens counted since the last count."""

    rid: int
    item: Any
    tokens: int


@dataclass(frozen=True, slots=True)
class Reasoning:
    """The request's reasoning phase: started (first), its token count, what ended it;
    ``answer``: the first answer token after it was sampled (then the rest is unused)."""

    rid: int
    #: when, on the monotonic clock the two processes share
    at: float
    tokens: int
    ended_by: str | None
    answer: bool = False


@dataclass(frozen=True, slots=True)
class Finish:
    """A natural end (``stop``/``length``)."""

    rid: int
    reason: EndReason
    tokens: int
    stop_sequence: str | None


@dataclass(frozen=True, slots=True)
class Fail:
    """The request failed in the worker's engine."""

    rid: int
    message: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Release:
    """The worker's engine let go of the request (its KV cells are free or cached)."""

    rid: int
    #: every request this one shared a step with
    batched_with: list[str]
    #: the worker engine's counters at the release, for the parent's metrics
    statistics: BatchStatistics | None
    #: tokens drafted and verified for the request, and those accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    #: tokens generated that no item, finish or failure carried (a cancel's last ones)
    tokens: int = 0
    #: why drafting was on or off for the request
    draft_decision: str | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """Several messages in one frame, in the order they were sent (a decode step's)."""

    messages: tuple[ToParent, ...]


@dataclass(frozen=True, slots=True)
class Pong:
    """The heartbeat's answer: the engine's loop was between two steps."""

    n: int


#: what the parent sends
ToWorker = Load | Start | Cancel | Credit | Close | Ping
#: what the worker sends
ToParent = (
    Ready | LoadError | Admit | Prompt | Cached | Read | Item | Reasoning
    | Finish | Fail | Cancel | Release | Pong
)  # fmt: skip


#: every kind, numbered by its place here (the number goes on the pipe)
_KINDS: tuple[type[Any], ...] = (
    Load, Start, Credit, Close, Cancel, Ready, LoadError, Admit, Prompt, Cached, Item,
    Finish, Fail, Release, Reasoning, Ping, Pong, Step, Read,
)  # fmt: skip
_CODES = {kind: code for code, kind in enumerate(_KINDS)}


def _getter(kind: type[Any]) -> Callable[[Any], tuple[Any, ...]]:
    names = [f.name for f in fields(kind)]
    if not names:
        return lambda _message: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda message: (one(message),)
    return operator.attrgetter(*names)


_GETTERS = {kind: _getter(kind) for kind in _KINDS}


_STEP = _CODES[Step]


def encode(message: ToWorker | ToParent | Step) -> tuple[Any, ...]:
    """``message`` as the tuple that is pickled: its kind's number, then its fields (a
    ``Step``'s messages each as its own tuple)."""
    kind = type(message)
    if kind is Step:
        return (_STEP, [encode(m) for m in cast(Step, message).messages])
    return (_CODES[kind], *_GETTERS[kind](message))


def step_of(wires: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The wire form of a ``Step`` of messages already encoded (the worker encodes each
    as it is sent, then frames a step's at its end)."""
    return wires[0] if len(wires) == 1 else (_STEP, wires)


def decode(wire: tuple[Any, ...]) -> ToWorker | ToParent | Step:
    """The record ``encode`` made ``wire`` from."""
    if wire[0] == _STEP:
        return Step(tuple(cast(ToParent, decode(w)) for w in wire[1]))
    return cast("ToWorker | ToParent", _KINDS[wire[0]](*wire[1:]))


def messages(wire: tuple[Any, ...]) -> list[ToParent]:
    """What a frame from the worker holds: its one message, or a step's, in order."""
    if wire[0] == _STEP:
        return [cast(ToParent, decode(w)) for w in wire[1]]
    return [cast(ToParent, decode(wire))]


def frame(message: ToWorker | ToParent) -> bytes:
    """``message`` as ``multiprocessing.connection.Connection.recv`` reads it (then
    ``decode`` it)."""
    data = pickle.dumps(encode(message), protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!iQ", -1, len(data)) + data
    return struct.pack("!i", len(data)) + data


def input_waiter(conn: Connection) -> Callable[[], object]:
    """A call that sleeps until ``conn`` has something to read (or has ended), for a
    thread to make before each ``recv``.

    A thread blocked reading a Unix socket is woken each time the far end takes
    something written on that socket (there is room to write again), and reads on. Both
    ends write and read one socket: the worker's reader woke each time the parent took a
    frame of the engine's loop (once a token, on the cores llama.cpp's threads use), the
    parent's each time the worker took a credit. ``poll`` for input wakes only for input.
    """
    poller = select.poll()
    try:
        poller.register(conn.fileno(), select.POLLIN)
    except OSError:
        return lambda: None  # a closed pipe: its recv says so
    return poller.poll
