"""Defaults that every surface shares: the SDK, the HTTP service, the web page, the chat.

One place, so that a reply stops at the same length whichever way it was asked for, and
the documentation (README, ``--help``, the page's settings) can quote one number.
"""

from __future__ import annotations

#: the longest reply, in tokens, when a request names no ``max_tokens``
DEFAULT_MAX_TOKENS = 512
