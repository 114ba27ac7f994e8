"""A function tool the structured-output tests share (OpenAI's ``tools`` shape)."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}},
            "required": ["city"],
        },
    },
}


def trigger_fires(grammar: object, text: str) -> bool:
    """Whether llama.cpp's own lazy grammar sampler, fed ``text`` as the default model's
    tokens one by one as a decode loop would, starts constraining: its triggers as
    llama.cpp matches them, not as a Python regex would. From the token it fires on, a
    sampler would only let the call through, so feeding stops there."""
    import ctypes

    import llama_cpp

    from tokenbelt.engines.llama import _grammar, _native
    from tokenbelt.models import default_model_path

    model = _native.load_vocab(default_model_path())
    sampler = _grammar.init_grammar_sampler(llama_cpp, model.vocab, grammar)
    try:
        # Pieces no call's start allows: a constraining grammar refuses one of them.
        probes = [
            t
            for word in ("Hello", " maybe", "!!!")
            for t in model.tokenize(word.encode(), False, False)
        ]
        data = (llama_cpp.llama_token_data * len(probes))()

        def constrained() -> bool:
            for slot, token in zip(data, probes, strict=True):
                slot.id, slot.logit, slot.p = token, 0.0, 0.0
            array = llama_cpp.llama_token_data_array(data, len(probes), -1, False)
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
            return any(slot.logit == float("-inf") for slot in data)

        for token in model.tokenize(text.encode("utf-8"), False, False):
            llama_cpp.llama_sampler_accept(sampler, token)
            if constrained():
                return True
        return False
    finally:
        llama_cpp.llama_sampler_free(sampler)
        model.close()


def trigger_matches(pattern: str, text: str) -> bool:
    """Whether llama.cpp matches one trigger ``pattern`` against its buffer ``text``: a
    pattern that is ``^...$`` whole, any other searched anywhere (``$`` is the end)."""
    import re

    ecma = pattern[:-1] + "\\Z" if pattern.endswith("$") else pattern
    if pattern.startswith("^") and pattern.endswith("$"):
        return re.fullmatch(ecma[1:-2], text, re.DOTALL) is not None
    return re.search(ecma, text, re.DOTALL) is not None
