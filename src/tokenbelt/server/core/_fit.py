"""A long conversation fitted to the context window by leaving its oldest turns out.

Ollama's chat does this for every request (its window is ``options.num_ctx``), and the
Responses API when a request says ``truncation: "auto"``: the system messages at the
head stay, the latest message stays, and the oldest turns between them go until the
prompt leaves the reply room. A turn starts at a user or an assistant message, never at
a tool result, so a tool call and its result are dropped together (and a template never
sees a result whose call is gone). A cut leaves out the fewest turns that hold a whole
multiple of a quarter of the window (``cut_limit``): the next turns of the conversation
then start where this one did, and their prompt comes from the prefix cache instead of
being computed again (cut by the fewest turns, every turn of a full chat would start one
turn later: a whole prefill each, seconds on a CPU). How many messages went is the
trace's ``dropped_messages``; the usage counts the prompt that ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..._errors import InvalidArgument, PromptTooLong
from ...engines import GenerationRequest, more_room
from ...runtime import Model
from ._errors import UnsupportedParameter

#: the roles that head a conversation and are never left out
HEAD_ROLES = frozenset({"system", "developer"})
#: at most this share of the window is kept free for the reply (less when the request
#: asks for fewer tokens)
REPLY_SHARE = 4
#: a cut leaves out whole multiples of this share of the window: as a conversation grows
#: by a few turns, its cut stays where it was, and its prompt comes from the prefix cache
GRID_SHARE = 4


@dataclass(frozen=True)
class Fit:
    """A chat to fit into ``window`` tokens. ``asked_by``: the request's field that asked
    for it. ``required``: that field is refused where the engine counts no tokens here
    (a remote engine); else such a chat goes on whole, for its upstream to fit or
    refuse. ``asked``: a larger window the request asked for than the model is loaded
    with (Ollama would load it again with that one): the chat then loses no turn, since
    that window would have held it; one that does not fit the loaded window is refused,
    naming the field."""

    window: int
    asked_by: str | None = None
    asked: int | None = None
    required: bool = False


def reply_room(request: GenerationRequest, window: int) -> int:
    """The tokens a fitted prompt leaves for the reply: what the request asks for, up to
    a quarter of the window (a conversation is not cut to its last turn for the sake of
    a reply as long as the window)."""
    return max(1, min(request.sampling.max_tokens, window // REPLY_SHARE))


def cut_limit(whole: int, room: int, window: int) -> int:
    """The most tokens a cut prompt may take, ``whole`` tokens before the cut: it leaves
    out a whole multiple of a quarter of the window, the least that leaves ``room``."""
    grid = max(1, window // GRID_SHARE)
    need = whole + room - window
    return whole - -(-need // grid) * grid


def fit_messages(
    model: Model, request: GenerationRequest, fit: Fit
) -> tuple[GenerationRequest, int]:
    """``request`` with as few of its oldest turns left out as it takes for the prompt to
    take at most ``cut_limit`` tokens, else to leave ``reply_room`` tokens of
    ``fit.window``, else one; and how many messages went. Unchanged when it fits, when it
    is not a chat, or when the engine counts no tokens here (a remote engine: its
    upstream fits, or refuses, the prompt itself). Raises ``PromptTooLong`` when the
    system messages with the latest turn alone are too long for the window. Blocks to
    tokenize: call it off the event loop."""
    messages = request.messages
    if messages is None or len(messages) < 2:
        return request, 0
    counter = _counter(model, request)
    if counter is None:
        if fit.required:
            raise UnsupportedParameter(
                fit.asked_by or "truncation",
                f"the {model.name} engine counts no prompt tokens here: its upstream "
                "decides what fits",
            )
        return request, 0
    window = fit.window
    count, whole = counter
    room = reply_room(request, window)
    if whole + room <= window:
        return request, 0
    if fit.asked is not None:
        if whole < window:
            return request, 0  # whole, with less room for the reply: the window it asked held it
        raise UnsupportedParameter(
            fit.asked_by or "num_ctx",
            f"the chat takes {whole} prompt tokens: a window of {fit.asked} would hold it, "
            f"but the model is loaded with a context window of {window} tokens (load it "
            "with a larger one: tokenbelt serve --n-ctx)",
        )
    head = 0
    while head < len(messages) - 1 and messages[head].get("role") in HEAD_ROLES:
        head += 1
    last = len(messages) - 1
    starts = [
        i for i in range(head + 1, last + 1) if i == last or messages[i].get("role") != "tool"
    ]

    def without(start: int) -> GenerationRequest:
        return dataclasses.replace(request, messages=(*messages[:head], *messages[start:]))

    def tokens(start: int) -> int | None:
        try:
            return count(without(start))
        except InvalidArgument:  # the template refuses to start there (roles must alternate)
            return None

    # On the grid (the cache's friend), else the fewest turns, else room for one token.
    for limit in (cut_limit(whole, room, window), window - room, window - 1):
        start = _first_fit(starts, tokens, limit)
        if start is not None:
            return without(start), start - head
    least = tokens(last)
    said = f"{least} prompt tokens, more" if least is not None else "more prompt tokens"
    larger = more_room(least or whole, window, model.info.get("context_length"))
    raise PromptTooLong(
        f"the latest message{' with the system messages' if head else ''}"
        f"{' and the tools' if request.tools else ''} takes {said} than a context window "
        f"of {window} tokens holds with room for a reply, even with every earlier turn left "
        f"out: {larger}"
    )


def _counter(
    model: Model, request: GenerationRequest
) -> tuple[Callable[[GenerationRequest], int], int] | None:
    """How to count a request's prompt tokens exactly, and ``request``'s own count; None
    where the engine has no vocabulary here."""

    def count(r: GenerationRequest) -> int:
        return len(model.prompt_token_ids(r))

    whole = model.prompt_token_ids_here(request, keep=True)  # submitted as it is, mostly
    return None if whole is None else (count, len(whole))


def _first_fit(starts: list[int], tokens: Callable[[int], int | None], limit: int) -> int | None:
    """The earliest start whose prompt takes at most ``limit`` tokens (a later start never
    takes more: binary search); None when not even the last does. A start the template
    refuses counts as too long."""
    lo, hi, found = 0, len(starts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        n = tokens(starts[mid])
        if n is not None and n <= limit:
            found, hi = starts[mid], mid - 1
        else:
            lo = mid + 1
    return found
