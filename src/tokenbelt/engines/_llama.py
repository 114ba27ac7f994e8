"""The llama.cpp engine: the real decode loop, with a checkpoint at every safe point.

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

import atexit
import codecs
import ctypes
import functools
import json
import logging
import random
import threading
from pathlib import Path
from typing import Any

from .._errors import Cancelled, DecodeError, IllegalState, ModelLoadError, PromptTooLong
from ..belt import EndReason, Producer
from ._base import GenerationRequest, SamplingParams, refuse, refuse_grammar
from ._loading import check_gguf_file, load_with_deadline

logger = logging.getLogger("tokenbelt.engines.llama")

#: what the batch engine (the runtime's) does and this one does not
_UNSUPPORTED = ("logit_bias", "logprobs")

_LOG_CALLBACK: Any = None


def _quiet_native_logs() -> None:
    """Route llama.cpp's own log lines to ``logging`` (debug) instead of stderr."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return
    import llama_cpp

    native = logging.getLogger("tokenbelt.engines.llama.native")

    def forward(level: int, text: bytes, _data: object) -> None:
        if native.isEnabledFor(logging.DEBUG):
            native.debug("%s", text.decode("utf-8", "replace").rstrip())

    _LOG_CALLBACK = llama_cpp.llama_log_callback(forward)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    # The binding opens two /dev/null files at import and never closes them, which
    # Python reports as unclosed at exit; close them then.
    from llama_cpp import _utils

    for name in ("outnull_file", "errnull_file"):
        handle = getattr(_utils, name, None)
        if handle is not None:
            atexit.register(handle.close)


def _flag_abort_callback() -> Any:
    """An abort hook that reads a one-byte flag without Python or the GIL.

    llama.cpp calls the hook between graph nodes with our ``data`` pointer and
    aborts when it returns true. ``strlen`` on a two-byte buffer returns 1 when the
    first byte is set and 0 otherwise: a native, lock-free flag check. Where libc
    is not at hand, a Python callback does the same job, with the GIL.
    """
    import llama_cpp

    try:
        strlen = ctypes.CDLL(None).strlen
        address = ctypes.cast(strlen, ctypes.c_void_p).value or 0
        return llama_cpp.ggml_abort_callback(address)
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return llama_cpp.ggml_abort_callback(
            lambda data: bool(ctypes.cast(data, ctypes.POINTER(ctypes.c_char))[0] != b"\0")
        )


def chat_formatter(model: Any) -> Any:
    """A chat formatter from the GGUF's own template (None if it has none).

    ``model`` is llama-cpp-python's ``_internals.LlamaModel``.
    """
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = model.metadata().get("tokenizer.chat_template")
    if not template:
        return None
    eos, bos = model.token_eos(), model.token_bos()
    return Jinja2ChatFormatter(
        template=template,
        eos_token=model.token_get_text(eos) if eos != -1 else "",
        bos_token=model.token_get_text(bos) if bos != -1 else "",
    )


@functools.lru_cache(maxsize=16)
def _template_tools(template: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def template_tools(formatter: Any) -> bool:
    """Whether a chat formatter's template renders tools itself (its Jinja source reads
    the ``tools`` variable, as Qwen2.5 and Hermes templates do)."""
    template = getattr(formatter, "template", None)
    return isinstance(template, str) and _template_tools(template)


def load_vocab(path: str | Path) -> Any:
    """A model file's vocabulary and metadata only (llama-cpp-python's ``LlamaModel``, a
    few MB, no weights): to tokenize and read its template without loading it. Close it
    with ``close()``. Raises ``ModelLoadError``."""
    import llama_cpp
    from llama_cpp import _internals

    _quiet_native_logs()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    try:
        return _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(f"llama.cpp could not load {path}: {exc}") from exc


def held_back(stopper: _StopMatcher, decoder: codecs.IncrementalDecoder) -> str:
    """The text a reply held back when it ends: what was kept for stop strings. The
    bytes of a character left unfinished (a reply cut at ``max_tokens`` inside a
    multi-byte character) are dropped, not shown as U+FFFD."""
    decoder.reset()
    return stopper.flush()


def prompt_tokens(model: Any, formatter: Any, request: GenerationRequest, name: str) -> list[int]:
    """A request's prompt tokens: a raw prompt as is, chat messages through ``formatter``
    (the GGUF's template), with the request's tools when the template renders them.
    ``model`` is llama-cpp-python's ``_internals.LlamaModel``."""

    def tokenize(text: str, *, add_bos: bool, special: bool) -> list[int]:
        return list(model.tokenize(text.encode("utf-8"), add_bos, special))

    if request.prompt is not None:
        return tokenize(request.prompt, add_bos=True, special=False)
    if formatter is None:
        raise DecodeError(f"{name} has no chat template; send a raw prompt instead")
    tools = json.loads(request.tools) if request.tools and template_tools(formatter) else None
    try:
        result = formatter(messages=list(request.messages or ()), tools=tools)
    except Exception as exc:
        raise DecodeError(f"the chat template failed: {exc}") from exc
    return tokenize(result.prompt, add_bos=not result.added_special, special=True)


class _StopMatcher:
    """Holds back text that might be the start of a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        #: the stop string that was hit (the earliest in the text), once one is
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        held = self.held + text
        hits = [(i, s) for i, s in ((held.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            at, self.matched = min(hits)
            return held[:at], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(held)), 0, -1):
                if held.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self.held = held[len(held) - keep :]
        return held[: len(held) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class LlamaEngine:
    """One llama.cpp context (one slot) over a GGUF model file.

    ``generate`` is blocking and runs on the producer thread; only one request
    runs at a time. Use ``LlamaEngine.load()`` to load under a deadline.
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
        path = check_gguf_file(model_path)
        _quiet_native_logs()
        from llama_cpp import Llama

        try:
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
        self._abort_callback = _flag_abort_callback()
        self._no_abort = llama_cpp.ggml_abort_callback()  # a NULL hook: never abort
        self._busy = threading.Lock()
        self._conversation: str | None = None
        self._closed = False
        self._formatter = chat_formatter(self._llm._model)
        #: whether the GGUF's chat template renders tools (then requests carry ``tools``)
        self.template_tools = template_tools(self._formatter)

    @classmethod
    def load(
        cls, model_path: str | Path, *, load_timeout: float | None = None, **options: Any
    ) -> LlamaEngine:
        """Load under ``load_timeout`` seconds; raises ``LoadTimeout`` or ``ModelLoadError``."""
        check_gguf_file(model_path)
        return load_with_deadline(
            lambda: cls(model_path, **options),
            load_timeout,
            what=Path(model_path).name,
            on_late=lambda engine: engine.close(),
        )

    # -- prompts -----------------------------------------------------------------------------

    def tokenize_request(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens for a request (chat template from the GGUF metadata)."""
        return prompt_tokens(self._llm._model, self._formatter, request, self.name)

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
        stopper = _StopMatcher(s.stop)
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
