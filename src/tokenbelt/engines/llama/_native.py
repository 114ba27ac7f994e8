"""llama.cpp helpers the engines share: the chat template, the vocabulary, prompt tokens
and stop strings.

``chat_formatter``, ``template_tools`` and ``tool_format`` read a GGUF's own chat template;
``load_vocab`` opens a model's vocabulary without its weights (the worker's parent
tokenizes with it); ``prompt_tokens`` turns a request into tokens; ``StopMatcher``
holds back text that may start a stop string, and ``held_back`` gives it up at the end.
"""

from __future__ import annotations

import codecs
import functools
import json
from pathlib import Path
from typing import Any

from ..._errors import DecodeError, InvalidArgument, ModelLoadError
from .._request import GenerationRequest
from ._binding import quiet_native_logs


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


#: the tool-call families ``tool_format`` tells apart (``tokenbelt``: the fallback)
TOOL_FORMATS = ("tokenbelt", "hermes", "llama3", "mistral")


def format_of_template(template: str) -> str:
    """The call family a chat template's text is written for (one of ``TOOL_FORMATS``):
    ``hermes`` (Hermes and Qwen: ``<tool_call>``), ``mistral`` (``[TOOL_CALLS]``),
    ``llama3`` (``<|python_tag|>``, or Llama 3.1/3.2's ``Environment: ipython`` and
    ``"parameters"`` JSON call), else ``tokenbelt``. A template that does not render
    ``tools`` is ``tokenbelt`` whatever it mentions: the documented format describes
    the tools to it."""
    if not _template_tools(template):
        return "tokenbelt"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return "llama3"
    if '"parameters"' in template:
        return "llama3"
    return "tokenbelt"


def tool_format(formatter: Any) -> str:
    """The tool-call family of a chat formatter's template (see ``format_of_template``)."""
    template = getattr(formatter, "template", None)
    return format_of_template(template) if isinstance(template, str) else "tokenbelt"


def load_vocab(path: str | Path) -> Any:
    """A model file's vocabulary and metadata only (llama-cpp-python's ``LlamaModel``, a
    few MB, no weights): to tokenize and read its template without loading it. Close it
    with ``close()``. Raises ``ModelLoadError``."""
    import llama_cpp
    from llama_cpp import _internals

    quiet_native_logs()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    try:
        return _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(f"llama.cpp could not load {path}: {exc}") from exc


def held_back(stopper: StopMatcher, decoder: codecs.IncrementalDecoder) -> str:
    """The text a reply held back when it ends: what was kept for stop strings. The
    bytes of a character left unfinished (a reply cut at ``max_tokens`` inside a
    multi-byte character) are dropped, not shown as U+FFFD."""
    decoder.reset()
    return stopper.flush()


def prompt_tokens(
    model: Any,
    formatter: Any,
    request: GenerationRequest,
    name: str,
    options: dict[str, Any] | None = None,
) -> list[int]:
    """A request's prompt tokens: a raw prompt as is, its special tokens' text read as
    those tokens as llama.cpp's server, Ollama (``raw``) and vLLM read it (editors such as
    Zed write a FIM prompt's markers as text); its token ids as given; chat
    messages through ``formatter`` (the GGUF's template), with the request's tools when
    the template renders them and ``options`` (template variables: a thinking model's
    ``enable_thinking``).
    ``model`` is llama-cpp-python's ``_internals.LlamaModel``."""

    def tokenize(text: str, *, add_bos: bool, special: bool) -> list[int]:
        return list(model.tokenize(text.encode("utf-8"), add_bos, special))

    if request.prompt is not None:
        return tokenize(request.prompt, add_bos=True, special=True)
    if request.prompt_tokens is not None:
        n_vocab = int(model.n_vocab())
        for token in request.prompt_tokens:
            if token >= n_vocab:
                raise InvalidArgument(
                    f"prompt: token id {token} is not in {name}'s vocabulary (0 to {n_vocab - 1})",
                    param="prompt",
                )
        return list(request.prompt_tokens)  # as given: no start token is added
    if formatter is None:
        raise DecodeError(f"{name} has no chat template; send a raw prompt instead")
    tools = json.loads(request.tools) if request.tools and template_tools(formatter) else None
    try:
        result = formatter(messages=list(request.messages or ()), tools=tools, **(options or {}))
    except Exception as exc:
        raise DecodeError(f"the chat template failed: {exc}") from exc
    prompt = result.prompt
    if request.continue_final:
        prompt = _cut_after_final_turn(prompt, (request.messages or ())[-1]["content"], name)
    return tokenize(prompt, add_bos=not result.added_special, special=True)


def _cut_after_final_turn(prompt: str, final: str, name: str) -> str:
    """The rendered conversation up to the end of its final assistant turn's text, so
    the reply continues it: what the template writes after that text (its end-of-turn
    marker, a new turn's header) goes. A template that trims the text is matched on the
    trimmed text; one that does not write it as given cannot be continued."""
    for text in (final, final.strip()):
        at = prompt.rfind(text)
        if text and at >= 0:
            return prompt[: at + len(text)]
    raise InvalidArgument(
        f"{name}'s chat template does not write the final assistant turn's text as "
        "given, so the reply cannot continue it",
        param="messages",
    )


class StopMatcher:
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
