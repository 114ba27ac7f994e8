"""What goes into the batch engine's next step: pure Python, no model.

``StepCosts`` keeps what this engine's steps took (a moving average per small step size,
and a prompt token's cost in big steps) and answers what a step of ``n`` tokens should
take. ``StepPlan.rows`` decides the next step from the running sequences:

- one decode row for every decoding sequence whose belt has room (a full belt leaves
  its sequence out: a slow reader pauses only its own stream and costs no compute), a
  thinking sequence's forced end marker when its deadline is within a step's lead, and
  a prompt-lookup draft where it pays (``_draft.py``) within the batch's room;
- prompt chunks of admitted sequences: while any sequence decodes, as many tokens as
  the measured prompt rate fits in ``prefill_gap`` seconds (at least ``prefill_chunk``),
  so a long new prompt pauses running streams for about that long a step rather than
  for its whole prefill; up to ``n_batch`` when none decodes (the fastest first token).

``follows`` is the admission rule for a request whose prompt another sequence is
computing right now, and ``retiring`` says who leaves before the step. The engine
writes the plan's rows into llama.cpp's batch; the plan never touches native state,
so ``tests/engines/llama/test_plan.py`` runs it in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ...belt import EndReason
from ._draft import best_length, expected_accepted
from ._sequence import Sequence

#: steps with at least this many tokens time the prompt rate (smaller ones are mostly
#: fixed costs)
PROMPT_TIMED_TOKENS = 64
#: steps of at most this many tokens are timed per size (a forced marker's step, a
#: drafted step: ``draft_tokens`` is at most 64)
TIMED_STEP_TOKENS = 64
#: the tokens of the first embedding ubatch beside chat, before any cost is measured
FIRST_SHARED_TOKENS = 16
#: the most seconds of chat steps saved up as credit for embeddings
MAX_CREDIT_S = 0.5
#: beside other decoding sequences, a draft is weighed only where a step of twice the
#: rows costs at most this many times the step (memory-bound steps: a GPU's, an f32
#: model's here): on the default Q4_1 model on 2 cores (1.67 times), drafts beside 4 and
#: 8 streams that the costs said paid lost 8-10% of the batch's tokens a second
#: (``benchmarks/serving.py``, 2026-12-07), where alone they gain
CHEAP_ROWS = 1.5


def _moving(average: float | None, sample: float) -> float:
    """A step timing's moving average: the first sample, then a fifth of each new one."""
    return sample if average is None else 0.8 * average + 0.2 * sample


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StepCosts:
    """What this engine's steps took, and what a step of ``n`` tokens should take."""

    def __init__(self) -> None:
        #: seconds a step of n tokens took (moving average, n <= TIMED_STEP_TOKENS)
        self.steps: dict[int, float] = {}
        #: seconds a prompt token costs in a big step (moving average; None: not timed)
        self.prompt: float | None = None

    def record(self, n_tokens: int, took: float, *, prefill: bool) -> None:
        """A step of ``n_tokens`` took ``took`` seconds (``prefill``: it read a prompt).

        Per size, only steps of decoding sequences are timed (what a forced marker and a
        draft cost): a prompt chunk's rows but its last have no logits, so a step that
        reads one costs less than a step of as many sampled rows (on the default model
        each row's logits are about a fifth of its cost), and would make drafts look
        cheap."""
        if not prefill and n_tokens <= TIMED_STEP_TOKENS:
            self.steps[n_tokens] = _moving(self.steps.get(n_tokens), took)
        if prefill and n_tokens >= PROMPT_TIMED_TOKENS:
            self.prompt = _moving(self.prompt, took / n_tokens)

    def step(self, n: int) -> float | None:
        """Seconds a step of ``n`` tokens is expected to take: as timed here, else by a
        straight line through the nearest sizes timed (None: nothing timed yet)."""
        costs = self.steps
        one = costs.get(1)
        # No step costs more than its tokens one at a time: a step timed while the machine
        # stalled would otherwise keep drafts of that size off for good.
        most = float("inf") if one is None else n * one
        known = costs.get(n)
        if known is not None:
            return min(known, most)
        sizes = sorted(costs)
        if not sizes:
            return None
        if len(sizes) == 1:
            # One size timed: each token past the first about half a one-token step.
            m = sizes[0]
            return costs[m] * (n + 1) / (m + 1)
        below = [m for m in sizes if m < n]
        above = [m for m in sizes if m > n]
        if below and above:
            lo, hi = below[-1], above[0]
        elif below:
            lo, hi = sizes[-2], sizes[-1]
        else:
            lo, hi = sizes[0], sizes[1]
        slope = max(0.0, (costs[hi] - costs[lo]) / (hi - lo))
        return min(most, max(1e-6, costs[lo] + slope * (n - lo)))


class TimeShare:
    """Embeddings' share of the loop beside chat: each chat step's seconds are credit
    (up to ``MAX_CREDIT_S``), each embedding ubatch's seconds are spent from it, and a
    ubatch runs only while there is credit, with as many tokens as the credit buys at
    the measured cost of an embedded token. An input is never split, so a ubatch of one
    input may overdraw; the next steps then run chat alone."""

    def __init__(self) -> None:
        #: seconds an embedded token costs (a moving average over ubatches; None: none yet)
        self.per_token: float | None = None
        #: seconds of compute embeddings may still take beside chat
        self.credit = 0.0

    def budget(self, chat_s: float | None, cap: int, whole: int) -> int:
        """The tokens of the next ubatch (0: none this step): ``whole`` when the step had
        no chat work (``chat_s`` None), else what the credit buys, at most ``cap``."""
        if chat_s is None:
            self.credit = 0.0
            return whole
        self.credit = min(self.credit + chat_s, MAX_CREDIT_S)
        if self.credit <= 0:
            return 0
        if self.per_token is None:
            return min(cap, FIRST_SHARED_TOKENS)
        return max(1, min(cap, int(self.credit / self.per_token)))

    def spent(self, took: float, n_tokens: int) -> None:
        """A ubatch of ``n_tokens`` took ``took`` seconds."""
        cost = took / n_tokens
        self.per_token = cost if self.per_token is None else 0.7 * self.per_token + 0.3 * cost
        self.credit -= took


@dataclass(slots=True)
class Row:
    """A sequence's part of a step: ``k`` of its tokens from ``n_past`` on, then its
    ``draft`` (every draft row is sampled)."""

    seq: Sequence
    k: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether the step samples after its last token (it reaches the prompt's end)."""
        return self.seq.n_past + self.k == len(self.seq.tokens)


@dataclass(slots=True)
class Plan:
    """The next step: its rows in batch order, and who waits for a reader's room."""

    rows: list[Row]
    waiting: list[Sequence]

    @property
    def n_tokens(self) -> int:
        return sum(r.k + len(r.draft) for r in self.rows)


class StepPlan:
    """Which rows go into the next step (module docstring)."""

    def __init__(
        self,
        *,
        n_batch: int,
        slots: int,
        prefill_chunk: int,
        prefill_gap: float,
        draft_tokens: int,
        costs: StepCosts,
    ) -> None:
        self.n_batch = n_batch
        self.slots = slots
        self.prefill_chunk = prefill_chunk
        self.prefill_gap = prefill_gap
        self.draft_tokens = draft_tokens
        self.costs = costs

    def prompt_chunk(self) -> int:
        """The most tokens a step carries while sequences decode: what the measured
        prompt rate fits in ``prefill_gap``, at least ``prefill_chunk``, at most a batch
        with a row for every slot."""
        chunk = self.prefill_chunk
        cost = self.costs.prompt
        if self.prefill_gap > 0 and cost is not None and cost > 0:
            chunk = max(chunk, int(self.prefill_gap / cost))
        return min(chunk, self.n_batch - self.slots)

    def marker_lead(self, seq: Sequence, decoding: int) -> float:
        """How long before a thinking deadline the end marker must go in, beside
        ``decoding - 1`` other decoding sequences, for the answer's first token to come
        out by the deadline: the step that decodes the marker, plus the plain step the
        loop would run first if it waited (each as timed on this machine: a step of a few
        tokens costs several one-token steps on a CPU)."""
        if seq.fmt is None:
            return 0.0
        plain = self.costs.step(decoding) or 0.0
        return plain + (self.costs.step(decoding + len(seq.fmt.end_tokens)) or 0.0)

    def rows(self, running: Iterable[Sequence], now: float) -> Plan:
        """The next step for the admitted, running sequences (in admission order) at
        monotonic time ``now``. A thinking sequence within its deadline's lead gets its
        end marker appended here; every sequence's ``draft`` is set."""
        active = [s for s in running if s.id >= 0 and not s.cancelled]
        decoding = [s for s in active if s.decoding]
        waiting: list[Sequence] = []
        stepping: list[Sequence] = []
        for seq in decoding:
            if seq.think_until is not None and now + self.marker_lead(seq, len(decoding)) >= (
                seq.think_until
            ):
                # Its end marker goes in this step: waiting one more would put the
                # answer's first token past the deadline.
                seq.end_reasoning("deadline")
            if seq.producer.has_room():
                stepping.append(seq)
            else:
                waiting.append(seq)
        rows: list[Row] = []
        n = 0
        tokens = 0.0  # what the rows so far are expected to yield
        for i, seq in enumerate(stepping):
            # One token, or more when the engine appended some (a forced end marker).
            k = len(seq.tokens) - seq.n_past
            draft: list[int] = []
            if seq.lookup is not None and k == 1:
                # Room in the batch for this draft and one token for every sequence after
                # it; weighed against the step as it stands: earlier drafts included.
                later = len(stepping) - i - 1
                spare = self.n_batch - n - k - later
                draft = self.draft_for(seq, (n + k + later, tokens + k + later), spare)
            seq.draft = draft
            rows.append(Row(seq, k, draft))
            n += k + len(draft)
            tokens += k
            if draft and seq.lookup is not None:
                tokens += expected_accepted(seq.lookup.rate, len(draft))
        plain = n - sum(len(r.draft) for r in rows)
        # Drafts do not take the prompts' share of a step, only the batch's room.
        budget = min((self.prompt_chunk() if decoding else self.n_batch) - plain, self.n_batch - n)
        for seq in active:
            if seq.decoding or budget <= 0:
                continue
            k = min(budget, len(seq.tokens) - seq.n_past)
            if seq.n_past + k == len(seq.tokens) and not seq.producer.has_room():
                waiting.append(seq)
                continue
            seq.draft = []
            rows.append(Row(seq, k))
            budget -= k
        return Plan(rows, waiting)

    def rows_are_cheap(self, rows: int) -> bool:
        """Whether a step of twice ``rows`` rows costs at most ``CHEAP_ROWS`` times one of
        ``rows`` here (False while either is unknown)."""
        one, two = self.costs.step(rows), self.costs.step(2 * rows)
        return one is not None and two is not None and two <= CHEAP_ROWS * one

    def draft_for(self, seq: Sequence, step: tuple[int, float], spare: int) -> list[int]:
        """The draft to verify with the sequence's pending token in a step of ``step``
        (its rows, and the tokens they are expected to yield, without this draft): a
        prompt lookup, as long as it pays (``_draft.py``), within the belt's room, the
        reply's length and the batch's ``spare`` rows."""
        lookup = seq.lookup
        assert lookup is not None
        lookup.settle(seq.tokens)
        # Each accepted token and the correction go on the belt in this step.
        limit = min(
            self.draft_tokens, seq.max_new - seq.produced - 1, seq.producer.room() - 1, spare
        )
        proposal = lookup.propose(seq.tokens, limit)
        if not proposal:
            return []
        rows, tokens = step
        length = 0
        if rows == 1 or self.rows_are_cheap(rows):
            length = best_length(lookup.rate, rows, len(proposal), self.costs.step, tokens)
        if length == 0 and rows == 1:
            length = lookup.probe(seq.produced, len(proposal))
        if length == 0:
            lookup.shadow(seq.tokens, proposal)  # measured for free: it may pay later
            return []
        lookup.drop_shadow()
        return proposal[:length]


def follows(seq: Sequence, running: Iterable[Sequence]) -> bool:
    """True while another sequence is still computing prompt cells ``seq`` can copy: the
    choices of one request (``n``), or the same prompt sent twice, compute their shared
    prompt once. A leader that waits for its reader is not waited for. (The caller asks
    only with the prefix cache on and a request that reuses prefixes.)"""
    limit = len(seq.tokens) - 1
    for other in running:
        if other is seq or other.id < 0 or other.cancelled or other.decoding:
            continue
        if other.waiting_room:
            continue
        if min(common_prefix(other.tokens, seq.tokens), limit) > other.n_past:
            return True
    return False


def retiring(running: Iterable[Sequence]) -> list[tuple[Sequence, bool]]:
    """Who leaves before the next step, and whether its cells become a cache entry: a
    stopped or ended request. A stopped one's computed cells stay cached (the same
    prompt again, or the conversation going on after a Stop, starts from them); a
    failed one's do not."""
    return [
        (seq, seq.producer.end_reason is not EndReason.RUNTIME_ERROR)
        for seq in running
        if seq.cancelled or seq.producer.end_reason is not None
    ]
