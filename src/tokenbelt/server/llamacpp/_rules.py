"""How llama.cpp's server ends an infill early, applied as its pieces are read.

``t_max_predict_ms``: once that long has passed since the first token and a newline
was generated (the completion ends at the end of a line). ``n_indent``: a new line that
starts with less indentation than the cursor's ends the completion, and what that line
holds after its indentation is cut (the block is over). Both as llama.cpp's
``server_context::process_token`` has them, so an editor sees the same text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class LineRules:
    """The stopping rules of one completion; ``feed`` each piece as it is read."""

    #: the least indentation a new line must have (0: no rule)
    n_indent: int = 0
    #: seconds after the first token from which a newline ends the completion (None: no rule)
    predict_s: float | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    #: the completion's text so far (cut where ``n_indent`` ended it)
    text: str = ""
    #: a newline was generated
    has_new_line: bool = False
    #: why it ended early: ``time`` or ``indent`` (None: it did not)
    stopped: str | None = None
    _started: float | None = None
    _line_start: int = 0

    def feed(self, piece: str) -> bool:
        """Take one piece; True when the completion must end here."""
        now = self.clock()
        if self._started is None:
            self._started = now
        self.text += piece
        if "\n" in piece:
            self.has_new_line = True
            if self.predict_s is not None and now - self._started > self.predict_s:
                self.stopped = "time"
                return True
        if self.has_new_line and self.n_indent > 0:
            if self._line_start > 0 and self._indent_short():
                return True
            at = self.text.find("\n", self._line_start)
            if at >= 0:
                self._line_start = at + 1
        return False

    def _indent_short(self) -> bool:
        pos, indent = self._line_start, 0
        while pos < len(self.text) and self.text[pos] in " \t":
            indent += 1
            pos += 1
        if pos < len(self.text) and indent < self.n_indent:
            self.text = self.text[:pos]
            self.stopped = "indent"
            return True
        return False
