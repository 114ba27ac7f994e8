"""Prompt-lookup drafting: drafts taken from the sequence itself, and whether they pay.

A draft is the run of tokens that followed an earlier occurrence of the sequence's last
tokens (prompt and reply so far): its last four, else three, else two (``_KEYS``). Of
that key's latest ``_CANDIDATES`` occurrences, the one whose text agrees with the
sequence's furthest back is taken (``agreement``, up to ``_AGREE_MAX`` tokens): after
the reply changed a word of the text it copies, the tokens after the change find every
place they occur, and the agreement picks the place the reply is copying, not the
latest one (often in the reply itself, or another sentence).

The batch engine decodes the pending token and the draft in one step, with logits for
every row, and samples the rows in order with the sequence's own sampler: a draft token
is accepted while the sample equals it, the first sample that differs is the
correction. Every produced token is a sample of the sampler, so the text is the
sampler's whatever the draft: greedy text is the same with drafting and without, up to
llama.cpp's rounding, which differs for a row computed in a bigger step (as it does
beside other sequences, ``clear_prefix_cache``): at a near tie of two tokens either may
come out. A q8_0 KV cache computes every row alike (``LlamaConfig.kv_type``).

Whether it pays, per sequence (``Lookup``):

- acceptance is measured per *band* of agreement (``BANDS``): a draft found by two
  tokens only is accepted about half the time on an edit, one whose source agrees for
  six tokens or more nearly always (measured on the default model: first token accepted
  40-56% against 86-100%). Each band's ``p`` is the chance that the next draft token
  is accepted given the ones before it were: accepted tokens over accepted tokens plus
  misses (a draft that ends in a correction is one miss), every settled draft weighing
  the band's past by ``_DECAY``, so it follows the text (a copied passage, then free
  prose). Each band starts from ``PRIORS``;
- a draft of ``L`` tokens then gains ``p + p^2 + ... + p^L`` tokens per step, and costs
  the step the engine measured for ``batch + L`` tokens instead of ``batch``
  (``step_cost``: its moving average per step size: the model's row costs on this
  machine). ``best_length`` takes the ``L`` with the most tokens per second for the
  whole batch (a bigger step slows every sequence in it), and 0 when none beats plain
  steps by ``_MARGIN``;
- while a band does not pay, its proposals are not computed (the step is a plain one)
  but kept as a *shadow* draft and compared with the tokens then sampled: the same
  acceptance count, measured for free, so a sequence that starts to copy (or starts an
  edit) turns drafting back on by itself;
- a step cost is only known for sizes that ran lately: when the shadow drafts are
  accepted (``p >= _PROBE_RATE``) but the costs say no, a short draft is verified at
  most once every ``_PROBE_EVERY`` tokens (``probe``), so that a cost measured while the
  machine was busy is measured again.

``decision`` says, when the request ends, why drafting was on or off for it (the
trace's ``draft_decision``, ``/metrics``' ``tokenbelt_draft_requests_total``).
"""

from __future__ import annotations

from collections.abc import Callable

#: the keys looked up, longest first: the sequence's last this many tokens
_KEYS = (4, 3, 2)
#: the latest occurrences of a key kept, ranked by their agreement
_CANDIDATES = 8
#: the furthest back an agreement is counted
_AGREE_MAX = 16
#: the bands' lowest agreements: found by two tokens, by a few more, by a run
BANDS = (2, 3, 6)
#: each band's estimate's start, as (accepted, misses): 1/2, 2/3, 4/5, what a draft in
#: each band was accepted at least on the edits measured (a prior worth one or two
#: drafts: the first drafts settled decide)
PRIORS = ((1.0, 1.0), (2.0, 1.0), (4.0, 1.0))
#: the weight of a band's past at each of its settled drafts (about the last ten count)
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

#: why drafting was on or off for a request (``Lookup.decision``, and the engine's own
#: for a request that never had a lookup)
DECISIONS = (
    "on",  # drafts were verified
    "no_gain",  # drafts were found, but their measured acceptance never paid the rows
    "nothing_to_copy",  # the reply never repeated a pair of tokens of its text
    "constrained",  # a grammar or a thinking phase: one token a step
    "asked_off",  # the request or the engine asked for no drafting
)


def expected_accepted(p: float, length: int) -> float:
    """Tokens a draft of ``length`` adds on average: ``p + p^2 + ... + p^length``."""
    if p >= 1.0:
        return float(length)
    return p * (1.0 - p**length) / (1.0 - p)


def best_length(
    p: float,
    batch: int,
    limit: int,
    step_cost: Callable[[int], float | None],
    tokens: float | None = None,
) -> int:
    """The draft length (at most ``limit``) with the most tokens per second for a step of
    ``batch`` rows that yields ``tokens`` (default: one a row; less where other
    sequences' drafts are among the rows), or 0 when drafting does not pay (or no cost is
    known yet)."""
    plain = step_cost(batch)
    if plain is None or plain <= 0 or limit <= 0:
        return 0
    base = float(batch) if tokens is None else tokens
    best, best_rate = 0, base / plain * (1.0 + _MARGIN)
    for length in (*(n for n in _LENGTHS if n < limit), limit):
        cost = step_cost(batch + length)
        if cost is None or cost <= 0:
            continue
        rate = (base + expected_accepted(p, length)) / cost
        if rate > best_rate:
            best, best_rate = length, rate
    return best


def agreement(tokens: list[int], at: int, end: int) -> int:
    """How many tokens before ``at`` equal those before ``end`` (at most ``_AGREE_MAX``)."""
    n = 0
    while n < _AGREE_MAX and at - 1 - n >= 0 and tokens[at - 1 - n] == tokens[end - 1 - n]:
        n += 1
    return n


def band_of(agreed: int) -> int:
    """The band of a draft whose source agrees for ``agreed`` tokens (at least two)."""
    band = 0
    for i, low in enumerate(BANDS):
        if agreed >= low:
            band = i
    return band


class Lookup:
    """One sequence's key index, its acceptance per band and its totals.

    ``propose`` indexes what was added since its last call (each key ending before the
    sequence's end, mapped to its latest ends) and looks the end up: a few dict and list
    operations per token, and at most ``_CANDIDATES`` agreements of a few comparisons.
    Used by the engine's loop thread only.
    """

    __slots__ = (
        "_ends",
        "_estimates",
        "_indexed",
        "_probe_at",
        "_shadow",
        "_shadow_at",
        "_shadow_band",
        "accepted",
        "band",
        "declined",
        "drafted",
        "proposed",
    )

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # keys ending before this index are in _ends
        #: each band's decayed (accepted, misses), behind ``rate``
        self._estimates = [list(prior) for prior in PRIORS]
        #: the band of the latest proposal
        self.band = 0
        #: the request's totals: draft tokens verified, and those accepted
        self.drafted = 0
        self.accepted = 0
        #: proposals found, and those the costs turned down (``decision``)
        self.proposed = 0
        self.declined = 0
        self._shadow: list[int] | None = None
        self._shadow_at = 0
        self._shadow_band = 0
        self._probe_at = _PROBE_EVERY

    @property
    def rate(self) -> float:
        """The chance that a draft token of the latest proposal's band is accepted after
        the ones before it were."""
        return self.rate_of(self.band)

    def rate_of(self, band: int) -> float:
        seen, misses = self._estimates[band]
        return seen / (seen + misses)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the earlier occurrence of the end of
        ``tokens`` that agrees furthest back (the latest among equals), or none; sets
        ``band``."""
        end = len(tokens)
        ends = self._ends
        for e in range(max(self._indexed, min(_KEYS)), end):
            for n in _KEYS:
                if e >= n:
                    found = ends.setdefault(tuple(tokens[e - n : e]), [])
                    found.append(e)
                    if len(found) > _CANDIDATES:
                        del found[0]
        self._indexed = max(self._indexed, end)
        if limit <= 0:
            return []
        best, agreed = -1, -1
        for n in _KEYS:
            if end > n and (places := ends.get(tuple(tokens[end - n :]))):
                for at in reversed(places):
                    m = agreement(tokens, at, end)
                    if m > agreed:
                        best, agreed = at, m
                break
        if best < 0:
            return []
        self.band = band_of(agreed)
        self.proposed += 1
        return tokens[best : best + limit]

    def observe(self, accepted: int, missed: bool, band: int | None = None) -> None:
        """A settled draft of ``band`` (the latest proposal's): ``accepted`` tokens, then
        a correction (``missed``) or not."""
        estimate = self._estimates[self.band if band is None else band]
        estimate[0] = estimate[0] * _DECAY + accepted
        estimate[1] = estimate[1] * _DECAY + (1.0 if missed else 0.0)

    def probe(self, produced: int, available: int) -> int:
        """A short draft's length to verify although the costs say no (see above), or 0."""
        if self.rate < _PROBE_RATE or produced < self._probe_at:
            return 0
        self._probe_at = produced + _PROBE_EVERY
        return min(_PROBE_LENGTH, available)

    def shadow(self, tokens: list[int], draft: list[int]) -> None:
        """Remember ``draft`` (not computed) to compare with what is sampled next."""
        self.declined += 1
        if self._shadow is None and draft:
            self._shadow, self._shadow_at, self._shadow_band = draft, len(tokens), self.band

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
            self.observe(same, True, self._shadow_band)
        elif same == len(draft):
            self.observe(same, False, self._shadow_band)
        else:
            return  # not sampled far enough yet
        self._shadow = None

    def drop_shadow(self) -> None:
        self._shadow = None

    def decision(self) -> str:
        """Why drafting was on or off for this request (one of ``DECISIONS``)."""
        if self.drafted:
            return "on"
        return "no_gain" if self.proposed else "nothing_to_copy"
