"""A fill-in-the-middle prompt from the model's own FIM tokens, laid out as llama.cpp's
server lays it out (``format_prompt_infill``), so that a prompt here and one there are
the same tokens:

    [<repo>project\\n][<file_sep>name\\ntext ...][<file_sep>filename\\n]
    <pre>prefix middle <suf>suffix <mid>

(``spm``: the suffix part first.) The prefix keeps its end and the suffix its start:
the prefix takes at most three quarters of a batch's worth and the suffix the rest;
the extra files fill what the context has left, the latest kept.
"""

from __future__ import annotations

from typing import Any

from ..._errors import InvalidArgument
from .._infill import FIM_TOKENS, Infill, InfillPrompt, fim_missing, no_fim_reason

#: the local context (prefix and suffix) takes at most this many tokens, as llama-server's
#: default batch of 2048 does; the extra files take what is left of the context
LOCAL_TOKENS = 2048
#: llama.cpp's separator between snippets where the vocabulary has no file separator
_SNIPPET = "\n\n--- snippet ---\n\n"


def read_fim_tokens(lib: Any, vocab: Any) -> dict[str, int]:
    """The FIM tokens the vocabulary has (``llama_vocab_fim_*``: set in the GGUF's
    metadata, or found by their text when the model was loaded)."""
    found: dict[str, int] = {}
    for part in FIM_TOKENS:
        token = int(getattr(lib, f"llama_vocab_fim_{part}")(vocab))
        if token >= 0:
            found[part] = token
    return found


def infill_prompt(
    lib: Any,
    model: Any,
    fim: dict[str, int],
    infill: Infill,
    *,
    name: str,
    context_length: int,
    max_tokens: int,
) -> InfillPrompt:
    """The prompt tokens of ``infill`` for a model whose FIM tokens are ``fim``; raises
    ``InvalidArgument`` naming the model and the tokens it lacks."""
    missing = fim_missing(fim)
    if missing:
        raise InvalidArgument(no_fim_reason(name, missing), param="suffix")

    def tokens(text: str) -> list[int]:
        return list(model.tokenize(text.encode("utf-8"), False, False)) if text else []

    extra: list[int] = []
    if "rep" in fim:
        extra += [fim["rep"], *tokens(infill.project + "\n")]
    for filename, text in infill.extra:
        extra += [fim["sep"], *tokens(filename + "\n")] if "sep" in fim else tokens(_SNIPPET)
        extra += tokens(text)
    if "sep" in fim:
        extra += [fim["sep"], *tokens(infill.filename + "\n")]
    prefix, suffix, middle = tokens(infill.prefix), tokens(infill.suffix), tokens(infill.middle)
    # What generation needs, then the local context, then the extra files.
    room = max(0, context_length - max_tokens - 4)
    local = min(LOCAL_TOKENS, room)
    prefix_take = min(len(prefix), 3 * (local // 4))
    suffix_take = min(len(suffix), max(0, local // 4 - (2 + len(middle))))
    extra_take = min(len(extra), max(0, room - prefix_take - suffix_take - len(middle)))
    truncated = (prefix_take, suffix_take, extra_take) != (len(prefix), len(suffix), len(extra))
    head = [fim["pre"], *prefix[len(prefix) - prefix_take :], *middle]
    tail = [fim["suf"], *suffix[:suffix_take]]
    first, second = (head, tail) if infill.order == "psm" else (tail, head)
    out = extra[len(extra) - extra_take :] if extra_take else []
    if lib.llama_vocab_get_add_bos(model.vocab):
        out = [int(lib.llama_vocab_bos(model.vocab)), *out]
    return InfillPrompt(tuple([*out, *first, *second, fim["mid"]]), truncated)
