"""The native side of a batch engine's step: llama.cpp's batch buffer and the decode.

``NativeStep`` owns the ``llama_batch`` the loop fills from a ``Plan``, runs
``llama_decode`` on the context with the thread count the ``ThreadTuner`` picks (a
decode step and a prompt step tune apart), times each step into ``StepCosts`` and
counts steps. It decides nothing: the plan says what goes in, ``StepInFlight`` says
when a running step is aborted. The loop's thread only.
"""

from __future__ import annotations

import time
from typing import Any

from ._plan import Plan, StepCosts
from ._sequence import Sequence
from ._threads import ThreadTuner, set_threads

#: a step's rows as the loop samples them: (sequence, tokens it added, row of its
#: logits or -1 when the step did not reach the end of its tokens)
Rows = list[tuple[Sequence, int, int]]


class NativeStep:
    """One context's batch buffer and decode call, with its timings and counters."""

    def __init__(
        self,
        lib: Any,
        ctx: Any,
        *,
        n_batch: int,
        slots: int,
        tuner: ThreadTuner | None,
        costs: StepCosts,
    ) -> None:
        self._lib = lib
        self._ctx = ctx
        self._slots = slots
        self._tuner = tuner
        self._costs = costs
        self._threads = 0  # the count the tuner last gave the context (0: none yet)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.steps = 0
        self.sequences = 0
        self.tokens = 0
        self.aborted = 0

    def _put(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        b = self.batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = int(logits)

    def fill(self, plan: Plan) -> Rows:
        """Write the plan's rows into the batch, in order."""
        rows: Rows = []
        n = 0
        for r in plan.rows:
            seq, k = r.seq, r.k
            for j, token in enumerate(seq.tokens[seq.n_past : seq.n_past + k]):
                self._put(n + j, token, seq.n_past + j, seq.id, False)
            last = n + k - 1 if r.samples else -1
            if last >= 0:
                self.batch.logits[last] = 1
            end = seq.n_past + k
            for j, token in enumerate(r.draft):  # every draft row is sampled
                self._put(n + k + j, token, end + j, seq.id, True)
            rows.append((seq, k + len(r.draft), last))
            n += k + len(r.draft)
        self.batch.n_tokens = n
        return rows

    def decode(self, rows: Rows, n_tokens: int) -> int:
        """Run the filled batch: ``llama_decode``'s code (0: done; 2: aborted)."""
        lib = self._lib
        reads = not all(seq.decoding for seq, _, _ in rows)  # a prompt chunk is in it
        kind = "prefill" if reads or n_tokens > self._slots else "decode"
        threads = 0
        if self._tuner is not None:
            threads = self._tuner.choose(kind)
            self._threads = set_threads(lib, self._ctx, threads, self._threads)
        started = time.perf_counter()
        ret = int(lib.llama_decode(self._ctx, self.batch))
        took = time.perf_counter() - started
        if ret == 0:
            if self._tuner is not None:
                self._tuner.record(kind, threads, took, n_tokens)
            self._costs.record(n_tokens, took, prefill=reads)
        else:
            self.aborted += 1
        self.steps += 1
        self.sequences += len(rows)
        self.tokens += n_tokens
        return ret

    def warm(self, tokens: list[int], seq_id: int) -> bool:
        """Compute ``tokens`` as sequence ``seq_id`` (the load's warm-up); whether it ran."""
        return self._alone(tokens, 0, seq_id, logits=True)

    def gap(self, tokens: list[int], start: int, seq_id: int) -> bool:
        """Compute ``tokens`` as sequence ``seq_id``'s cells from position ``start`` in a
        step of their own, no row sampled (a shifted reuse's gap, ``PrefixCache.reuse``);
        whether it ran (the abort flag stops it as any step)."""
        ran = self._alone(tokens, start, seq_id, logits=False)
        self.steps += 1
        self.sequences += 1
        self.tokens += len(tokens)
        if not ran:
            self.aborted += 1
        return ran

    def _alone(self, tokens: list[int], start: int, seq_id: int, *, logits: bool) -> bool:
        for i, token in enumerate(tokens):
            self._put(i, token, start + i, seq_id, logits and i == len(tokens) - 1)
        self.batch.n_tokens = len(tokens)
        ran = self._lib.llama_decode(self._ctx, self.batch) == 0
        self.batch.n_tokens = 0
        return bool(ran)

    def free(self) -> None:
        self._lib.llama_batch_free(self.batch)
