"""Defaults that every surface shares: the SDK, the HTTP service, the web page, the chat.

One place, so that a reply stops at the same length whichever way it was asked for, and
the documentation (README, ``--help``, the page's settings) can quote one number.
"""

from __future__ import annotations

import sys

#: the longest reply, in tokens, when a request names no ``max_tokens``
DEFAULT_MAX_TOKENS = 512

#: how many tokens generation may run ahead of each reader (belt capacity), unless a
#: request or the runtime says otherwise
DEFAULT_CAPACITY = 8
#: sequences a model decodes together in one context (``Runtime``; ``tokenbelt serve``
#: batches ``SERVE_SLOTS``)
DEFAULT_SLOTS = 1
#: tokens each request may hold (the prompt and the reply) when a user gives no context:
#: what the model was trained on (an agent's first request, its system prompt and tools,
#: is 6,000 to 23,000 tokens), lowered until its KV cache fits ``DEFAULT_KV_MEMORY``;
#: this many for a model that does not say what it was trained on
DEFAULT_N_CTX = 4096
#: the most bytes a model's KV cache (``slots`` sequences of the context each) takes when
#: a user gives no context: the default model's 4 slots of 8,192 tokens take 720 MiB
DEFAULT_KV_MEMORY = 1 << 30
#: a context lowered to fit ``DEFAULT_KV_MEMORY`` is a multiple of this many tokens
CONTEXT_STEP = 256
#: requests a model's admission queue holds before it refuses more
DEFAULT_QUEUE_SIZE = 16
#: the longest prompt-lookup draft one sequence verifies in a step
DEFAULT_DRAFT_TOKENS = 16
#: the bytes a model's prefix cache keeps in memory when a user gives no ``cache_tokens``:
#: as many tokens as this many bytes of the model's KV cells hold (the default model:
#: 46,603 tokens, 22.5 KiB each), so an agent's system prompt, tools and history are
#: read once, not at every turn
DEFAULT_CACHE_MEMORY = 1 << 30
#: the fewest tokens a prefix cache sized by memory keeps (a large model's cells are big)
MIN_CACHE_TOKENS = 4096
#: prefix-cache entries each model keeps when its cache is on
DEFAULT_CACHE_ENTRIES = 8
#: the shortest chunk of a prefix-cache entry kept past a changed part of a prompt (its
#: cells moved to where the prompt has it): llama.vim's advice for llama.cpp's
#: ``--cache-reuse``; a code completion's suffix (up to ~510 tokens) is one
DEFAULT_CACHE_REUSE = 256
#: how much nicer (lower in priority) llama.cpp's decode threads run than the rest of the
#: process, so the threads that deliver tokens (the HTTP loop, a worker's reader, the
#: caller's) get a core at once instead of waiting out a decode thread's time slice:
#: measured on 2 cores with the default model (``benchmarks/serving.py``), a lone stream's
#: inter-token p95 7.9 ms in-process and 9.9 ms through the worker at 10, against 10.4
#: and 11.4 ms at 0, tokens/s alike. Linux only (a thread's own niceness); elsewhere 0
DEFAULT_DECODE_NICE = 10 if sys.platform == "linux" else 0
#: seconds a batched step's prompt tokens may take while other streams decode: how long a
#: long new prompt may pause them at a time (a step of 128 prompt tokens, the least, can
#: take longer on a slow machine)
DEFAULT_PREFILL_GAP = 1.0

#: ``tokenbelt serve``'s slots: an HTTP service is shared, so it batches a few requests
SERVE_SLOTS = 4
#: ``tokenbelt serve``'s total limit per request, in seconds: the bound on a stream whose
#: client reads nothing while its kernel still accepts bytes. The SDK's ``Runtime`` has no
#: time limit unless given one (``Limits()``: every phase ``None``).
SERVE_TOTAL_TIMEOUT_S = 600.0
