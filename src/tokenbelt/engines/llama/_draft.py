"""Prompt-lookup drafting: drafts taken from the sequence itself, and whether they pay.

A draft is the run of tokens that followed the most recent earlier occurrence of the
sequence's last n tokens (prompt and reply so far; n = 3, else 2). The batch engine
decodes the pending token and the draft in one step, with logits for every row, and
samples the rows in order with the sequence's own sampler: a draft token is accepted
while the sample equals it, the first sample that differs is the correction. Every
produced token is a sample of the sampler, so the text is the sampler's whatever the
draft: greedy text is the same with drafting and without, up to llama.cpp's rounding,
which differs for a row computed in a bigger step (as it does beside other sequences,
``clear_prefix_cache``): at a near tie of two tokens either may come out.

Whether it pays, per sequence (``Lookup``):

- acceptance is one number ``p``, the chance that the next draft token is accepted
  given the ones before it were: accepted tokens over accepted tokens plus misses
  (a draft that ends in a correction is one miss), every settled draft weighing the
  past by ``_DECAY``, so it follows the text (a copied passage, then free prose);
- a draft of ``L`` tokens then gains ``p + p^2 + ... + p^L`` tokens per step, and costs
  the step the engine measured for ``batch + L`` tokens instead of ``batch``
  (``step_cost``: its moving average per step size). ``best_length`` takes the ``L``
  with the most tokens per second for the whole batch (a bigger step slows every
  sequence in it), and 0 when none beats plain steps by ``_MARGIN``;
- while it does not pay, the sequence drafts nothing (its steps are plain ones) but
  keeps proposing a *shadow* draft and compares it with the tokens it then samples:
  the same acceptance count, measured for free, so a sequence that starts to copy
  (or starts an edit) turns drafting back on by itself. It starts off, at
  ``p = 1/2``: the first shadow drafts decide;
- a step cost is only known for sizes that ran lately: when the shadow drafts are
  accepted (``p >= _PROBE_RATE``) but the costs say no, a short draft is verified at
  most once every ``_PROBE_EVERY`` tokens (``probe``), so that a cost measured while the
  machine was busy is measured again.
"""

from __future__ import annotations

from collections.abc import Callable

#: n-gram lengths looked up, longest first
_NGRAMS = (3, 2)
#: the estimate's start, as (accepted, misses): 1/2, which never pays
_PRIOR = (1.0, 1.0)
#: the weight of the past at each settled draft (about the last ten drafts count)
_DECAY = 0.9
#: drafting must promise this much more throughput than plain steps to be used
_MARGIN = 0.05
#: a sequence whose shadow drafts are accepted this often verifies a short draft ...
_PROBE_RATE = 0.8
#: ... at most once every this many tokens, with a draft of at most _PROBE_LENGTH
_PROBE_EVERY = 32
_PROBE_LENGTH = 4
#: draft lengths weighed (and the longest the proposal allows)
_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def expected_accepted(p: float, length: int) -> float:
    """Tokens a draft of ``length`` adds on average: ``p + p^2 + ... + p^length``."""
    if p >= 1.0:
        return float(length)
    return p * (1.0 - p**length) / (1.0 - p)


def best_length(p: float, batch: int, limit: int, step_cost: Callable[[int], float | None]) -> int:
    """The draft length (at most ``limit``) with the most tokens per second for a step of
    ``batch`` plain tokens, or 0 when drafting does not pay (or no cost is known yet)."""
    plain = step_cost(batch)
    if plain is None or plain <= 0 or limit <= 0:
        return 0
    best, best_rate = 0, batch / plain * (1.0 + _MARGIN)
    for length in (*(n for n in _LENGTHS if n < limit), limit):
        cost = step_cost(batch + length)
        if cost is None or cost <= 0:
            continue
        rate = (batch + expected_accepted(p, length)) / cost
        if rate > best_rate:
            best, best_rate = length, rate
    return best


class Lookup:
    """One sequence's n-gram index, its acceptance estimate and its totals.

    ``propose`` indexes what was added since its last call (each n-gram ending before
    the sequence's end, mapped to where it ended, the latest kept) and looks the end up:
    a few dict operations per token. Used by the engine's loop thread only.
    """

    __slots__ = (
        "_ends",
        "_indexed",
        "_probe_at",
        "_shadow",
        "_shadow_at",
        "accepted",
        "drafted",
        "misses",
        "seen",
    )

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in _ends
        self.seen, self.misses = _PRIOR  # the decayed counts behind ``rate``
        #: the request's totals: draft tokens verified, and those accepted
        self.drafted = 0
        self.accepted = 0
        self._shadow: list[int] | None = None
        self._shadow_at = 0
        self._probe_at = _PROBE_EVERY

    @property
    def rate(self) -> float:
        """The chance that a draft token is accepted after the ones before it were."""
        return self.seen / (self.seen + self.misses)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier match of the end of
        ``tokens`` (the longest n-gram first), or none."""
        end = len(tokens)
        ends = self._ends
        for e in range(max(self._indexed, min(_NGRAMS)), end):
            for n in _NGRAMS:
                if e >= n:
                    ends[tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end)
        if limit <= 0:
            return []
        for n in _NGRAMS:
            if end > n:
                at = ends.get(tuple(tokens[end - n :]))
                if at is not None:
                    return tokens[at : at + limit]
        return []

    def observe(self, accepted: int, missed: bool) -> None:
        """A settled draft: ``accepted`` tokens, then a correction (``missed``) or not."""
        self.seen = self.seen * _DECAY + accepted
        self.misses = self.misses * _DECAY + (1.0 if missed else 0.0)

    def probe(self, produced: int, available: int) -> int:
        """A short draft's length to verify although the costs say no (see above), or 0."""
        if self.rate < _PROBE_RATE or produced < self._probe_at:
            return 0
        self._probe_at = produced + _PROBE_EVERY
        return min(_PROBE_LENGTH, available)

    def shadow(self, tokens: list[int], draft: list[int]) -> None:
        """Remember ``draft`` (not computed) to compare with what is sampled next."""
        if self._shadow is None and draft:
            self._shadow, self._shadow_at = draft, len(tokens)

    def settle(self, tokens: list[int]) -> None:
        """Compare the shadow draft with the tokens sampled since; count it once known."""
        draft = self._shadow
        if draft is None:
            return
        got = tokens[self._shadow_at : self._shadow_at + len(draft)]
        same = 0
        while same < len(got) and got[same] == draft[same]:
            same += 1
        if same < len(got):
            self.observe(same, True)
        elif same == len(draft):
            self.observe(same, False)
        else:
            return  # not sampled far enough yet
        self._shadow = None

    def drop_shadow(self) -> None:
        self._shadow = None
