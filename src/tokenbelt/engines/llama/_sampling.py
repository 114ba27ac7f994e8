"""The batch engine's vocabulary side: sampler chains, sampling a row of a step, a
token's bytes, and the log-probabilities a request asked for.

``Vocabulary`` holds the native context and vocabulary it reads; it is used on the
engine's loop thread only (llama.cpp's samplers and logits are not thread-safe).
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

from ..._errors import InvalidArgument
from .._request import GenerationRequest, Piece, SamplingParams, TokenLogprob
from ._grammar import check_grammar
from ._reasoning import ANSWER, ReasoningFormat, check_reasoning
from ._sequence import Sequence


def check_logit_bias(s: SamplingParams, n_vocab: int, name: str) -> None:
    """``logit_bias`` names tokens of the model's vocabulary (``InvalidArgument``)."""
    for token, _bias in s.logit_bias:
        if token >= n_vocab:
            raise InvalidArgument(
                f"logit_bias: token {token} is not in {name}'s vocabulary (ids 0 to {n_vocab - 1})",
                param="logit_bias",
            )


def check_request(
    lib: Any,
    vocab: Any,
    n_vocab: int,
    request: GenerationRequest,
    name: str,
    reasoning: ReasoningFormat | None = None,
) -> None:
    """What only the model can check, before a request queues: ``logit_bias`` names
    tokens of its vocabulary, a grammar parses against it, and ``think`` asks what the
    chat template can do (``reasoning``: its markers) (``InvalidArgument``)."""
    check_logit_bias(request.sampling, n_vocab, name)
    check_reasoning(reasoning, request, name)
    if request.grammar is not None:
        s = request.sampling
        for field in ("ignore_eos", "min_tokens"):
            if getattr(s, field):
                # A grammar that is complete allows only the end: banning it leaves nothing.
                raise InvalidArgument(
                    f"{field} cannot be combined with a grammar (response_format, tools): "
                    "a complete grammar can only end the reply",
                    param=field,
                )
        check_grammar(lib, vocab, request.grammar)


class Vocabulary:
    """Sampling and scoring over one context's logits (the loop's thread only)."""

    def __init__(self, lib: Any, ctx: Any, vocab: Any, context_length: int) -> None:
        self._lib = lib
        self._ctx = ctx
        self.vocab = vocab
        self.n_vocab = int(lib.llama_vocab_n_tokens(vocab))
        self._context_length = context_length
        self._piece = ctypes.create_string_buffer(256)
        self._eog: list[int] | None = None

    def chain(self, s: SamplingParams) -> Any:
        """The sampler chain: bias, penalties, then greedy or top-k/top-p/min-p/temperature."""
        lib, n_vocab = self._lib, self.n_vocab
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if s.logit_bias:
            biases = (lib.llama_logit_bias * len(s.logit_bias))(*s.logit_bias)
            lib.llama_sampler_chain_add(
                chain, lib.llama_sampler_init_logit_bias(n_vocab, len(biases), biases)
            )
        if s.repeat_penalty != 1.0 and s.repeat_last_n != 0:
            last_n = self._context_length if s.repeat_last_n < 0 else s.repeat_last_n
            lib.llama_sampler_chain_add(
                chain, lib.llama_sampler_init_penalties(n_vocab, last_n, s.repeat_penalty, 0.0, 0.0)
            )
        if s.frequency_penalty or s.presence_penalty:
            # OpenAI counts every token generated so far: the window is the whole sequence.
            penalties = lib.llama_sampler_init_penalties(
                n_vocab, self._context_length, 1.0, s.frequency_penalty, s.presence_penalty
            )
            lib.llama_sampler_chain_add(chain, penalties)
        if s.temperature == 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(s.top_k))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(s.top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(s.min_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(s.temperature))
        seed = s.seed if s.seed is not None else random.getrandbits(31)
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        return chain

    def free(self, chain: Any) -> None:
        self._lib.llama_sampler_free(chain)

    def sample(self, seq: Sequence, row: int) -> int:
        """The token ``seq``'s sampler picks from the step's ``row``: through its grammar
        once its answer starts (reasoning comes first, free), with every end token
        banned under ``ignore_eos`` or ``min_tokens``. A grammar's ``DecodeError`` is
        raised for the caller to fail this sequence alone."""
        phases = seq.phases
        if seq.grammar is not None and (phases is None or phases.state == ANSWER):
            return int(seq.grammar.sample(seq.sampler, self._ctx, row))
        s = seq.request.sampling
        if s.ignore_eos or seq.produced < s.min_tokens:
            return self._sample_without_end(seq, row)
        return int(self._lib.llama_sampler_sample(seq.sampler, self._ctx, row))

    def is_end(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self.vocab, token))

    def end_tokens(self) -> list[int]:
        """Every end-of-generation token of the vocabulary (found once, when first asked)."""
        if self._eog is None:
            lib, vocab = self._lib, self.vocab
            self._eog = [t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(vocab, t)]
        return self._eog

    def _sample_without_end(self, seq: Sequence, row: int) -> int:
        """Sample with every end token's logit at -inf (``ignore_eos``, ``min_tokens``), as
        llama.cpp's server bans them; the logits are put back after, so the log-probabilities
        stay the model's own."""
        logits = self._lib.llama_get_logits_ith(self._ctx, row)
        ends = self.end_tokens()
        kept = [logits[t] for t in ends]
        for t in ends:
            logits[t] = float("-inf")
        try:
            return int(self._lib.llama_sampler_sample(seq.sampler, self._ctx, row))
        finally:
            for t, value in zip(ends, kept, strict=True):
                logits[t] = value

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        n = self._lib.llama_token_to_piece(self.vocab, token, self._piece, 256, 0, special)
        return self._piece.raw[: max(n, 0)]

    def detokenize(self, tokens: list[int]) -> str:
        raw = b"".join(self.token_bytes(t, special=True) for t in tokens)
        return raw.decode("utf-8", "replace")

    def scored(
        self, seq: Sequence, text: str, token: int, raw: bytes, row: int, reasoning: str = ""
    ) -> str:
        """``text`` as it goes on the belt: a ``Piece`` with the token's log-probability
        and id when the request asked for them (and its reasoning text, for a thinking
        model), else the plain string (the cheap path)."""
        s = seq.request.sampling
        ids = (token,) if s.return_token_ids else ()
        if not s.logprobs:
            return Piece(text, (), reasoning, ids) if reasoning or ids else text
        import numpy as np

        pointer = self._lib.llama_get_logits_ith(self._ctx, row)
        logits = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).astype(np.float64)
        peak = logits.max()
        logprobs = logits - (peak + np.log(np.exp(logits - peak).sum()))
        top: tuple[TokenLogprob, ...] = ()
        if s.top_logprobs:
            k = min(s.top_logprobs, self.n_vocab)
            best = np.argpartition(-logprobs, k - 1)[:k]
            best = best[np.argsort(-logprobs[best], kind="stable")]
            top = tuple(self._logprob(int(t), float(logprobs[t])) for t in best)
        chosen = TokenLogprob(raw.decode("utf-8", "replace"), float(logprobs[token]), raw, top)
        return Piece(text, (chosen,), reasoning, ids)

    def _logprob(self, token: int, logprob: float) -> TokenLogprob:
        raw = self.token_bytes(token)
        return TokenLogprob(raw.decode("utf-8", "replace"), logprob, raw)
