"""A deterministic engine that plays a script: the test double and the demo's kitchen."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .._errors import DecodeError, InvalidArgument, PromptTooLong
from ..belt import EndReason, Producer, check_duration
from ._base import OnThreads
from ._request import GenerationRequest, refuse, refuse_grammar


class ScriptedEngine(OnThreads):
    """Produces ``tokens`` one by one, ``delay`` seconds apart, honouring the belt.

    It has the loop shape every engine has (``slots``, a non-blocking ``start``,
    ``statistics``; see ``OnThreads``), so the scheduler runs it on the production path:
    each started request runs ``generate`` on a producer thread of its own. A test may
    override ``generate`` to play any engine behaviour.

    - ``prefill_delay``: seconds of "prefill" before the first token (interruptible,
      as llama.cpp's abort hook makes a real prefill);
    - ``fail_after``: raise ``DecodeError`` after that many tokens;
    - ``gate``: if given, each step also waits for this event *without* watching
      the belt, which stands for a native step that cannot be interrupted.

    Prompts are counted as one token per whitespace-separated word.
    """

    name = "scripted"
    #: no chat template: tools are described in the messages
    template_tools = False
    tool_format = "tokenbelt"
    reasoning = None

    def __init__(
        self,
        tokens: Sequence[str],
        *,
        delay: float = 0.01,
        prefill_delay: float = 0.0,
        fail_after: int | None = None,
        gate: threading.Event | None = None,
        context_length: int = 4096,
    ) -> None:
        super().__init__()
        self.tokens = list(tokens)
        self.delay = check_duration("delay", delay) or 0.0
        self.prefill_delay = check_duration("prefill_delay", prefill_delay) or 0.0
        if fail_after is not None and fail_after < 0:
            raise InvalidArgument(f"fail_after must be >= 0, got {fail_after}")
        self.fail_after = fail_after
        self.gate = gate
        self.context_length = context_length
        self.closed = False
        #: tokens computed by this engine over its life
        self.tokens_computed = 0

    @classmethod
    def from_text(cls, text: str, **kwargs: object) -> ScriptedEngine:
        """Split ``text`` into word pieces (each keeps its leading space)."""
        words = text.split(" ")
        pieces = [words[0]] + [" " + w for w in words[1:]]
        return cls([p for p in pieces if p], **kwargs)  # type: ignore[arg-type]

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        refuse_grammar(request, "the scripted engine")
        refuse(request.sampling, "scripted", "ignore_eos", "min_tokens", "return_token_ids")
        if request.prompt_tokens is not None:
            text = " ".join(map(str, request.prompt_tokens))  # a word a token, as any text
        elif request.prompt is not None:
            text = request.prompt
        else:
            text = " ".join(m["content"] for m in request.messages or ())
        n = len(text.split())
        if n >= self.context_length:
            raise PromptTooLong(
                f"the prompt has {n} tokens but the context holds {self.context_length}"
            )
        return n

    def _sleep(self, seconds: float, producer: Producer[str], woken: threading.Event) -> None:
        if seconds > 0:
            woken.wait(seconds)
        producer.checkpoint()

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        if self.closed:
            raise DecodeError("the engine is closed")
        woken = threading.Event()
        producer.on_cancel(lambda _reason: woken.set())
        producer.count_prompt(self.count_prompt_tokens(request))
        self._sleep(self.prefill_delay, producer, woken)
        limit = request.sampling.max_tokens
        for i, token in enumerate(self.tokens):
            if i >= limit:
                return EndReason.LENGTH
            producer.wait_for_room()
            if self.gate is not None:
                self.gate.wait()
            self._sleep(self.delay, producer, woken)
            if self.fail_after is not None and i >= self.fail_after:
                raise DecodeError(f"scripted failure after {i} tokens")
            self.tokens_computed += 1
            producer.count_token()
            producer.put(token)
        return EndReason.STOP

    def close(self) -> None:
        """Refuse further requests and wait for the producer threads to end."""
        self.closed = True
        self.join_producers()
