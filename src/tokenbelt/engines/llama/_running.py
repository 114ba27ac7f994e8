"""The batch engine's admitted sequences, on its loop's thread.

``Running`` holds every sequence the loop has taken from the inbox, and what a step does
to them: admission (the prompt's tokens, a cached prefix, an id, the sampler), the
planned step (``_plan.py``) decoded with the stop rule armed over it (``_inflight.py``,
``_step.py``), each row sampled and turned into belt items (``Sequence.accept``),
drafts verified, and retirement (the release first, then the cells into the prefix
cache). The engine (``_batch.py``) keeps what crosses threads: the inbox, the count of
started requests, the wake-ups, and the lifecycle.

Threads: the loop's only, but for ``thinking_expired`` (the deadline timer's thread),
which only aborts a step and wakes the loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..._errors import Cancelled, DecodeError
from ...belt import DeadlineTimer, EndReason
from ._config import LlamaConfig
from ._draft import DECISIONS, Lookup
from ._grammar import GrammarSampler
from ._inflight import StepInFlight
from ._plan import Plan, StepPlan, follows, retiring
from ._prefix import PrefixCache
from ._prompts import Prompts, check_fits
from ._reasoning import ReasoningFormat
from ._sampling import Vocabulary, check_logit_bias
from ._sequence import Sequence, ThinkingDeadline, parts
from ._step import NativeStep, Rows

#: at most this many other requests are named in one trace's ``batched_with``
_MAX_PEERS = 32


def note_peers(seqs: list[Sequence], most: int = _MAX_PEERS) -> None:
    """Name in each trace's ``batched_with`` the other requests of a step, up to ``most``
    names a trace (a long-lived stream beside many short ones stays bounded)."""
    ids = [seq.producer.trace.request_id for seq in seqs]
    for seq, own in zip(seqs, ids, strict=True):
        peers = seq.producer.trace.batched_with
        for other in ids:
            if len(peers) >= most:
                break
            if other != own:
                peers.add(other)


class Running:
    """The admitted sequences and what a step does to them (module docstring)."""

    def __init__(
        self,
        lib: Any,
        *,
        name: str,
        config: LlamaConfig,
        prompts: Prompts,
        words: Vocabulary,
        cells: PrefixCache,
        plan: StepPlan,
        step: NativeStep,
        inflight: StepInFlight,
        deadlines: DeadlineTimer,
        released: Callable[[], None],
        wake: Callable[[], None],
    ) -> None:
        self._lib = lib
        self._name = name
        #: the settings a step reads (each sequence's context, drafting for requests that
        #: do not choose)
        self._config = config
        self._prompts = prompts
        self._reasoning: ReasoningFormat | None = prompts.reasoning
        self._words = words
        self._cells = cells
        self._plan = plan
        self._step = step
        self._inflight = inflight
        self._deadlines = deadlines
        #: a started request let go of its slot (the engine counts it, under its lock)
        self._released = released
        #: wake the loop (a reader made room, a deadline passed)
        self._wake = wake
        #: in admission order; a sequence leaves at its retirement
        self.active: list[Sequence] = []
        #: wraps what goes to the producers together: a step's sampling (with the
        #: prefill's progress the step made), a request's start and prompt count, what
        #: the prefix cache held for it (a worker sends each as one frame)
        self.sampling: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
        self.drafted = 0
        self.accepted = 0
        #: requests by why drafting was on or off for them (``DECISIONS``)
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self._last_peers: list[Sequence] = []

    def step(self) -> int:
        """Admit who waits, retire who ended, then plan, decode and sample one step;
        the step's token count (0: nothing to compute)."""
        for seq in list(self.active):
            if seq.id < 0 and not seq.cancelled:
                self.admit(seq)
        for seq, cache in retiring(list(self.active)):
            self.retire(seq, cache=cache)
        plan = self._plan.rows(self.active, time.monotonic())
        for seq in plan.waiting:
            self._wait_room(seq)
        if plan.n_tokens:
            self.decode(plan)
        return plan.n_tokens

    def drain(self, left: list[Sequence], error: BaseException | None) -> None:
        """The loop ended: end and release ``left`` (a bug, or a close)."""
        for seq in left:
            if error is not None:
                seq.producer.fail(DecodeError(f"the batch loop failed: {error}"))
            else:
                seq.producer.cancel(EndReason.SHUTDOWN)
            self.retire(seq, cache=False)

    def _prepare(self, seq: Sequence) -> bool:
        """Start the request and tokenize its prompt (once); False if it failed."""
        p = seq.producer
        p.start()
        seq.prepared = True
        try:
            check_logit_bias(seq.request.sampling, self._words.n_vocab, self._name)
            tokens = self._prompts.take(seq.request)
            p.count_prompt(len(tokens))
            check_fits(len(tokens), self._config.n_ctx)
        except Exception as exc:
            p.fail(exc)
            self.retire(seq, cache=False)
            return False
        seq.set_prompt(tokens, self._config.n_ctx)
        if self._reasoning is not None and seq.request.messages is not None:
            tail = self._words.detokenize(seq.tokens[-8:])
            seq.open_phases(
                self._reasoning, tail, self._prompts.markers, self._config.n_ctx, self._thinking
            )
        return True

    def _thinking(self, seq: Sequence) -> None:
        """A sequence's reasoning phase started: its deadline's clock starts."""
        timeout = seq.request.sampling.reasoning_timeout
        if timeout is not None:
            seq.think_until = time.monotonic() + timeout
            seq.think_timer = ThinkingDeadline(seq, self._thinking_expired)
            self._deadlines.schedule(seq.think_timer, seq.think_until)

    def _thinking_expired(self, seq: Sequence) -> None:
        """On the timer's thread, at a thinking deadline: abort the step in flight when it
        computes only this sequence (the loop then forces the end marker into the next
        step, ``_plan.py``); a step shared with others runs on, so no one else pays."""
        if seq.think_until is not None:
            self._inflight.abort_if_alone(seq)
        self._wake()

    def admit(self, seq: Sequence) -> None:
        """Tokenize, find a cached prefix, take a sequence id, build the sampler; or wait
        a step while a sequence ahead computes the prompt this one shares."""
        if not seq.prepared:
            with self.sampling():  # its start and its prompt's count: one frame
                if not self._prepare(seq):
                    return
        cells = self._cells
        if cells.on and seq.request.reuse_prefix and follows(seq, self.active):
            return
        seq.id = cells.take_id()
        seq.sampler = self._words.chain(seq.request.sampling)
        if seq.request.grammar is not None:
            try:
                words = self._words
                seq.grammar = GrammarSampler(
                    self._lib, words.vocab, words.n_vocab, seq.request.grammar
                )
            except Exception as exc:
                seq.producer.fail(exc)
                self.retire(seq, cache=False)
                return
        drafts = (seq.request.draft or self._config.draft) == "lookup"
        if drafts and seq.grammar is None and seq.phases is None:
            seq.lookup = Lookup()
        if not seq.request.reuse_prefix:
            return  # cache_prompt: false computes the whole prompt
        held, reused = cells.reuse(seq, self.active, lambda *gap: self._gap(seq, *gap))
        if held > 0:
            seq.n_past = held
            with self.sampling():
                seq.producer.count_cached(reused)
                seq.producer.count_read(held)

    def _gap(self, seq: Sequence, tokens: list[int], start: int, seq_id: int) -> bool:
        """Compute the tokens between the chunks a shifted reuse keeps for ``seq``
        (``PrefixCache.reuse``), as sequence ``seq_id``, in a step of their own: a stop
        of ``seq`` aborts it as it would a step with its prompt."""
        self._inflight.begin([seq], self._plan.costs.step(len(tokens)) or 0.0)
        try:
            return self._step.gap(tokens, start, seq_id)
        finally:
            self._inflight.end()

    def _wait_room(self, seq: Sequence) -> None:
        """Leave a full sequence out; the read that makes room wakes the loop."""
        if seq.waiting_room:
            return
        seq.waiting_room = seq.producer.on_room(self._wake)
        if not seq.waiting_room:
            self._wake()  # room came (or the belt ended) since we looked: step again

    def decode(self, plan: Plan) -> None:
        """Run the planned step with the stop rule armed over it, then sample its rows."""
        rows = self._step.fill(plan)
        seqs = [seq for seq, _, _ in rows]
        for seq in seqs:
            seq.waiting_room = False
        self._inflight.begin(seqs, self._plan.costs.step(plan.n_tokens) or 0.0)
        ret = self._step.decode(rows, plan.n_tokens)
        self._inflight.end()
        if ret != 0:
            self._recover(rows, ret)
            return
        if len(rows) > 1:
            self._note_peers(seqs)
        # The prefill's progress goes with the step's tokens: the last prompt step's
        # count and the first token cross the worker's pipe as one frame, not two.
        with self.sampling():
            for seq, k, _ in rows:
                seq.n_past += k - len(seq.draft)  # a draft's cells count once verified
                if seq.n_past <= seq.n_prompt:
                    seq.producer.count_read(seq.n_past)  # the prefill's progress
            for seq, _, row in rows:
                if row >= 0 and not seq.cancelled:
                    if seq.draft:
                        self._verify(seq, row)
                    else:
                        self._sample(seq, row)
                elif seq.draft:
                    self._drop_draft(seq)

    def _verify(self, seq: Sequence, row: int) -> None:
        """Sample the pending token's row, then each draft row while the sample equals
        the draft token: each accepted token's cell is kept, the first sample that
        differs is the correction (the next pending token), the rest of the draft's
        cells are removed. Every token is the sampler's own (``_sample``), so its end
        tokens, stop strings, ``max_tokens`` and belt puts apply to each in turn."""
        draft = seq.draft
        lookup = seq.lookup
        assert lookup is not None
        # Counted before the walk: a token of it may end the request (and its trace).
        self.drafted += len(draft)
        lookup.drafted += len(draft)
        accepted = 0
        for i in range(len(draft) + 1):
            if seq.cancelled or not seq.producer.has_room():
                break  # the rest is not sampled: its cells go below
            self._sample(seq, row + i)
            if seq.id < 0:
                break  # it ended (an end token, a stop string, its length, a failure)
            if i == len(draft) or seq.tokens[-1] != draft[i]:
                break  # the correction, or the token after a draft accepted whole
            seq.n_past += 1  # the draft token's cell holds what was sampled
            accepted += 1
            self.accepted += 1
            lookup.accepted += 1
        lookup.observe(accepted, accepted < len(draft))
        self._drop_draft(seq)

    def _drop_draft(self, seq: Sequence) -> None:
        """Remove the cells past the sequence's verified tokens (an unaccepted draft)."""
        seq.draft = []
        if seq.id >= 0:
            self._cells.cut(seq.id, seq.n_past)

    def _note_peers(self, seqs: list[Sequence]) -> None:
        """Record in each trace which requests shared a step with it (when that changes)."""
        if seqs == self._last_peers:
            return
        self._last_peers = seqs
        note_peers(seqs)

    def _recover(self, rows: Rows, ret: int) -> None:
        """After an aborted or failed step: every sequence goes on from where its KV ends."""
        for seq, _, _ in rows:
            kept = self._cells.kept(seq.id)
            # Never past the tokens it holds: a draft's cells are not its tokens.
            seq.n_past = min(kept, len(seq.tokens))
            if seq.draft or kept > seq.n_past:
                self._drop_draft(seq)
        if ret == 2:
            return  # aborted for a stop: the cancelled sequences leave at the next step
        error = DecodeError(f"llama.cpp decode failed (code {ret})")
        for seq, _, _ in rows:
            if not seq.cancelled:
                seq.producer.fail(error)
            self.retire(seq, cache=False)

    def _sample(self, seq: Sequence, row: int) -> None:
        """Sample ``seq``'s token from the step's ``row`` and put what it becomes
        (``Sequence.accept``) on its belt; end the request when it ends it."""
        words = self._words
        try:
            token = words.sample(seq, row)
        except DecodeError as exc:  # a grammar failed: this sequence fails, the others go on
            seq.producer.fail(exc)
            self.retire(seq, cache=False)
            return
        end = words.is_end(token)
        raw = b"" if end else words.token_bytes(token)
        got = seq.accept(token, raw, end=end)
        piece = parts(got.text, got.reasoning)
        if got.scored:
            piece = words.scored(seq, got.text, token, raw, row, got.reasoning)
        if got.end is None:
            self._put(seq, piece)
        else:
            self._end(seq, piece, got.end)

    def _put(self, seq: Sequence, text: str) -> bool:
        try:
            seq.producer.put_nowait(text)
        except Cancelled:
            return False
        return True

    def _end(self, seq: Sequence, text: str, reason: EndReason) -> None:
        seq.close_phases()
        if self._put(seq, text):
            seq.producer.finish(reason)
        self.retire(seq, cache=reason.is_natural)

    def draft_counts(self) -> dict[str, Any]:
        """Drafting's counters, as ``BatchStatistics`` names them."""
        return {
            "draft_tokens": self.drafted,
            "accepted_draft_tokens": self.accepted,
            "draft_decisions": dict(self.decisions),
        }

    def _draft_decision(self, seq: Sequence) -> str:
        """Why drafting was on or off for ``seq`` (``_draft.DECISIONS``)."""
        if seq.lookup is not None:
            return seq.lookup.decision()
        if (seq.request.draft or self._config.draft) != "lookup":
            return "asked_off"
        return "constrained"

    def retire(self, seq: Sequence, *, cache: bool) -> None:
        """Run the sequence's exit hook and release it, then copy its cells into the
        prefix cache (when it is cached) and free them. The copy comes after the
        release: it takes milliseconds for a long sequence (about 23 KB a token on the
        default model), and a stop's release must not wait for the cache. Nothing else
        runs on this thread meanwhile: the cells are still whole when they are copied."""
        if seq in self.active:
            self.active.remove(seq)
        if seq.id >= 0:  # admitted: its drafting was decided (before its grammar goes)
            decision = self._draft_decision(seq)
            self.decisions[decision] += 1
            lookup = seq.lookup
            drafted, accepted = (0, 0) if lookup is None else (lookup.drafted, lookup.accepted)
            seq.producer.count_draft(drafted, accepted, decision)
        if seq.sampler is not None:
            self._words.free(seq.sampler)
            seq.sampler = None
        if seq.grammar is not None:
            seq.grammar.free()
            seq.grammar = None
        seq.close_phases()
        seq.think_until = seq.think_timer = None
        if seq.draft or seq.lookup is not None:
            self._drop_draft(seq)  # a cache entry holds its verified tokens only
        held, seq.id = seq.id, -1
        if seq.producer.end_reason is None:  # pragma: no cover - every path ends it first
            seq.producer.cancel(EndReason.SHUTDOWN)
        self._released()
        try:
            seq.on_exit()
        finally:
            seq.producer.release()
            if held >= 0:
                self._cells.retire(held, seq.tokens, seq.n_past, cache=cache)
