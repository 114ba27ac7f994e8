"""The single-sequence llama.cpp engine: one context, one request at a time.

The runtime does not use it: ``Runtime.load`` builds the batch engine (``_batch.py``,
THE decode loop) or the worker engine. ``LlamaEngine`` is kept only as a
single-sequence baseline on llama-cpp-python's own ``Llama`` object: ``benchmarks/sdk.py``
and ``benchmarks/sse.py`` measure against it (``benchmarks/engine.py`` measures the
batch engine against a bare ``Llama`` loop of its own).

Where cancellation lands:

- between prefill chunks (``belt.checkpoint()``);
- *inside* a running ``llama_decode`` through llama.cpp's abort hook, which reads a
  per-request flag the belt's cancel sets;
- before every decode step: ``belt.wait_for_room()``, which is also where a full
  belt pauses generation, so a slow reader costs no compute, and where a deadline
  that passed while nobody was waiting on the belt is noticed.

After any end that is not a natural one, the context forgets everything it held,
so the next request starts exactly as on a fresh load.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import random
import threading
from pathlib import Path
from typing import Any

from ..._errors import Cancelled, DecodeError, IllegalState, ModelLoadError, PromptTooLong
from ...belt import EndReason, Producer
from .._base import OnThreads
from .._request import GenerationRequest, SamplingParams, refuse, refuse_grammar
from ._binding import amx_safe, flag_abort_callback, quiet_native_logs
from ._loading import check_gguf_file, load_gguf
from ._native import (
    StopMatcher,
    chat_formatter,
    held_back,
    prompt_tokens,
    template_tools,
    tool_format,
)

logger = logging.getLogger("tokenbelt.engines.llama")

#: what the batch engine (the runtime's) does and this one does not
_UNSUPPORTED = (
    "logit_bias",
    "logprobs",
    "ignore_eos",
    "min_tokens",
    "return_token_ids",
    "repeat_last_n",
)


class LlamaEngine(OnThreads):
    """One llama.cpp context (one slot) over a GGUF model file.

    ``generate`` is blocking and runs on the producer thread; only one request
    runs at a time (``start``, from ``OnThreads``, runs it on a thread of its own).
    Use ``LlamaEngine.load()`` to load under a deadline.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_gpu_layers: int = 0,
        n_batch: int = 512,
        prefill_chunk: int = 256,
        name: str | None = None,
    ) -> None:
        super().__init__()
        path = check_gguf_file(model_path)
        quiet_native_logs()
        from llama_cpp import Llama

        try:
            with amx_safe():
                self._llm: Any = Llama(
                    str(path),
                    n_ctx=n_ctx,
                    n_threads=n_threads,
                    n_threads_batch=n_threads_batch,
                    n_gpu_layers=n_gpu_layers,
                    n_batch=n_batch,
                    verbose=False,
                )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load {path}: {exc}") from exc
        import llama_cpp

        self._lib = llama_cpp
        self.model_path = path
        self.name = name or path.stem
        self.context_length: int = self._llm.n_ctx()
        self.prefill_chunk = max(1, prefill_chunk)
        self._abort_callback = flag_abort_callback()
        self._no_abort = llama_cpp.ggml_abort_callback()  # a NULL hook: never abort
        self._busy = threading.Lock()
        self._conversation: str | None = None
        self._closed = False
        self._formatter = chat_formatter(self._llm._model)
        #: whether the GGUF's chat template renders tools (then requests carry ``tools``)
        self.template_tools = template_tools(self._formatter)
        self.tool_format = tool_format(self._formatter)

    @classmethod
    def load(
        cls, model_path: str | Path, *, load_timeout: float | None = None, **options: Any
    ) -> LlamaEngine:
        """Load under ``load_timeout`` seconds; raises ``LoadTimeout`` or ``ModelLoadError``."""
        return load_gguf(lambda: cls(model_path, **options), model_path, load_timeout)

    # -- prompts -----------------------------------------------------------------------------

    def tokenize_request(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens for a request (chat template from the GGUF metadata)."""
        return prompt_tokens(self._llm._model, self._formatter, request, self.name)

    def remember_prompt_tokens(self, request: GenerationRequest, tokens: list[int]) -> None:
        """Nothing is kept: this baseline tokenizes each prompt again when it starts."""

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        refuse(request.sampling, "single-context llama.cpp", *_UNSUPPORTED)
        refuse_grammar(request, "the single-context llama.cpp engine")
        n = len(self.tokenize_request(request))
        if n + 1 > self.context_length:
            raise PromptTooLong(
                f"the prompt has {n} tokens but the context window holds "
                f"{self.context_length} (including at least one generated token)"
            )
        return n

    # -- generation --------------------------------------------------------------------------

    def _forget(self) -> None:
        """Drop all context state: the next request starts as on a fresh load."""
        self._llm.n_tokens = 0
        self._llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        self._conversation = None

    def _prefill(self, tokens: list[int], conversation_id: str | None, belt: Producer[str]) -> None:
        llm = self._llm
        reuse = 0
        if conversation_id is not None and conversation_id == self._conversation:
            cached = llm.input_ids[: llm.n_tokens]
            limit = min(len(cached), len(tokens) - 1)
            while reuse < limit and cached[reuse] == tokens[reuse]:
                reuse += 1
        else:
            self._forget()
        llm.n_tokens = reuse  # eval() drops the KV cache from here on
        self._conversation = conversation_id
        for start in range(reuse, len(tokens), self.prefill_chunk):
            belt.checkpoint()
            llm.eval(tokens[start : start + self.prefill_chunk])
        belt.checkpoint()

    def _decode(self, tokens: list[int], s: SamplingParams, belt: Producer[str]) -> EndReason:
        llm = self._llm
        llm.set_seed(s.seed if s.seed is not None else random.getrandbits(31))
        max_new = min(s.max_tokens, self.context_length - len(tokens))
        vocab = llm._model.vocab
        is_eog = self._lib.llama_vocab_is_eog
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stopper = StopMatcher(s.stop)
        steps = llm.generate(
            tokens,
            top_k=s.top_k,
            top_p=s.top_p,
            min_p=s.min_p,
            temp=s.temperature,
            repeat_penalty=s.repeat_penalty,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
        )

        def flush() -> None:  # text held back for stop strings or an unfinished character
            tail = held_back(stopper, decoder)
            if tail:
                belt.put(tail)

        produced = 0
        try:
            while True:
                belt.wait_for_room()  # backpressure and the step's checkpoint
                token = next(steps)  # one decode step (prefill is already done)
                if is_eog(vocab, token):
                    flush()
                    return EndReason.STOP
                produced += 1
                belt.count_token()
                text, hit = stopper.feed(decoder.decode(llm.detokenize([token])))
                belt.put(text)
                if hit:
                    belt.trace.stop_sequence = stopper.matched
                    return EndReason.STOP
                if produced >= max_new:
                    flush()
                    return EndReason.LENGTH
        finally:
            steps.close()

    def generate(self, request: GenerationRequest, belt: Producer[str]) -> EndReason:
        if self._closed:
            raise IllegalState("the engine is closed")
        refuse_grammar(request, "the single-context llama.cpp engine")
        if not self._busy.acquire(blocking=False):
            raise IllegalState("this engine is already generating; one request per slot")
        flag = ctypes.create_string_buffer(2)  # per request: a late cancel hits only its own
        natural = False
        hooked = False
        try:
            refuse(request.sampling, "single-context llama.cpp", *_UNSUPPORTED)
            tokens = self.tokenize_request(request)
            belt.count_prompt(len(tokens))
            if len(tokens) + 1 > self.context_length:
                raise PromptTooLong(
                    f"the prompt has {len(tokens)} tokens but the context window holds "
                    f"{self.context_length}"
                )

            def abort(_reason: EndReason) -> None:
                flag[0] = b"\x01"

            self._lib.llama_set_abort_callback(
                self._llm._ctx.ctx, self._abort_callback, ctypes.cast(flag, ctypes.c_void_p)
            )
            hooked = True
            belt.on_cancel(abort)
            try:
                self._prefill(tokens, request.conversation_id, belt)
                reason = self._decode(tokens, request.sampling, belt)
            except RuntimeError as exc:  # llama_decode failed or was aborted
                if belt.cancelled:
                    raise Cancelled(belt.end_reason or EndReason.USER_CANCEL) from exc
                raise DecodeError(f"llama.cpp decode failed: {exc}") from exc
            natural = True
            return reason
        finally:
            if hooked:
                # The hook points at this request's flag, which is freed with the
                # request: left installed, any later decode on this context would
                # read freed memory and might abort for no reason.
                self._lib.llama_set_abort_callback(self._llm._ctx.ctx, self._no_abort, None)
            if not natural:
                self._forget()
            self._busy.release()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._busy.locked()

    def close(self) -> None:
        """Free the context and the model (native memory). Idempotent."""
        if self._closed:
            return
        # Freeing the context under a running llama_decode would crash the process:
        # wait for the request to end (the runtime cancels it first, so this is short).
        if not self._busy.acquire(timeout=30.0):
            logger.error("%s is still generating; not freeing its memory", self.name)
            return
        self._busy.release()
        self._closed = True
        llm = self._llm
        self._llm = None
        try:
            llm.close()
        except Exception:  # pragma: no cover - best effort on teardown
            logger.exception("closing %s failed", self.name)
