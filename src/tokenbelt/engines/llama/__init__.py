"""The llama.cpp engines: the batch engine (``_batch.py``: THE decode loop, where a stop
lands inside a step), its grammar sampler, thread tuning and loading, the native helpers
they share, and the single-sequence baseline the benchmarks measure against."""

from ._batch import BatchEngine
from ._binding import amx_safe, model_params, quiet_native_logs
from ._config import FLASH_ATTN, KV_TYPES, LlamaConfig, cache_tokens_for, context_that_fits
from ._embed import (
    MAX_EMBED_TOKENS,
    check_inputs,
    check_pooling,
    embedding_info,
    input_tokens,
    pair_tokens,
)
from ._gguf import GGUFHeader, parameter_size, read_header
from ._grammar import (
    CALL_ARGUMENTS,
    CALL_PREFIX,
    GrammarCacheInfo,
    GrammarSampler,
    call_arguments,
    check_enforceable,
    check_grammar,
    clear_schema_cache,
    functions_grammar,
    json_object_grammar,
    schema_cache_info,
    schema_grammar,
)
from ._loading import check_gguf_file, load_with_deadline
from ._native import (
    TOOL_FORMATS,
    chat_formatter,
    format_of_template,
    load_vocab,
    prompt_tokens,
    template_tools,
    tool_format,
)
from ._persist import DEFAULT_PREFIX_CACHE_DISK, check_disk_budget
from ._prompts import KeptPrompts, Prompts, check_fits, more_room
from ._reasoning import ReasoningFormat, detect_reasoning, template_options
from ._sampling import check_request
from ._single import LlamaEngine
from ._threads import (
    check_decode_nice,
    check_threads,
    default_threads,
    usable_cores,
)

__all__ = [
    "CALL_ARGUMENTS",
    "CALL_PREFIX",
    "DEFAULT_PREFIX_CACHE_DISK",
    "FLASH_ATTN",
    "KV_TYPES",
    "MAX_EMBED_TOKENS",
    "TOOL_FORMATS",
    "BatchEngine",
    "GGUFHeader",
    "GrammarCacheInfo",
    "GrammarSampler",
    "KeptPrompts",
    "LlamaConfig",
    "LlamaEngine",
    "Prompts",
    "ReasoningFormat",
    "amx_safe",
    "cache_tokens_for",
    "call_arguments",
    "chat_formatter",
    "check_decode_nice",
    "check_disk_budget",
    "check_enforceable",
    "check_fits",
    "check_gguf_file",
    "check_grammar",
    "check_inputs",
    "check_pooling",
    "check_request",
    "check_threads",
    "clear_schema_cache",
    "context_that_fits",
    "default_threads",
    "detect_reasoning",
    "embedding_info",
    "format_of_template",
    "functions_grammar",
    "input_tokens",
    "json_object_grammar",
    "load_vocab",
    "load_with_deadline",
    "model_params",
    "more_room",
    "pair_tokens",
    "parameter_size",
    "prompt_tokens",
    "quiet_native_logs",
    "read_header",
    "schema_cache_info",
    "schema_grammar",
    "template_options",
    "template_tools",
    "tool_format",
    "usable_cores",
]
