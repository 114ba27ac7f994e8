"""The body of llama.cpp's ``POST /infill``, as llama.vim and llama.vscode send it.

Every field llama.cpp's server documents for ``/infill`` that those clients send is
here; anything else is a 400 naming it (a parameter is never silently ignored).
``samplers`` is accepted as a stated choice: tokenbelt samples in its own order
(penalties, top-k, top-p, min-p, temperature), and the answer says so.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..._defaults import DEFAULT_MAX_TOKENS
from ...belt import RANGES
from ...engines import Infill
from ..core import TokenbeltOptions, ranges

#: the sampler names llama.cpp's ``samplers`` takes
SAMPLERS = frozenset(
    {"penalties", "dry", "top_n_sigma", "top_k", "typ_p", "typical_p", "top_p", "min_p", "xtc"}
    | {"temperature", "infill", "adaptive_p"}
)
#: most candidates ``n_cmpl`` may ask for (llama.vscode's default is 3)
MAX_CANDIDATES = 8


class InputChunk(BaseModel):
    """One file of ``input_extra``: a chunk of another file of the repository."""

    model_config = ConfigDict(extra="forbid", strict=True)

    filename: str = Field("tmp", description="the file's name (llama.cpp's default: tmp)")
    text: str = ""
    # llama.vim sends when it took the chunk (a reltime() list); llama.cpp reads it not
    time: list[int] | float | None = Field(None, description="accepted, no effect")


class InfillRequest(BaseModel):
    """``POST /infill``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="a loaded model's alias; default: the first")
    input_prefix: str = Field("", description="the text before the cursor")
    input_suffix: str = Field("", description="the text after the cursor")
    input_extra: list[InputChunk] = Field(
        default_factory=list,
        max_length=1024,
        description="other files' chunks, put before the prefix (repository layout)",
    )
    prompt: str = Field("", description="the current line up to the cursor, after the prefix")
    n_predict: int = Field(
        -1,
        ge=-1,
        le=int(RANGES["max_tokens"].high),
        description=f"most tokens to generate (-1: {DEFAULT_MAX_TOKENS}; 0: only compute the "
        "prompt, so that the prefix cache holds it: one token is generated and not returned, "
        "and t_max_prompt_ms does not apply)",
    )
    n_indent: int = Field(
        0, ge=0, le=1024, description="a new line with less indentation ends the completion"
    )
    t_max_prompt_ms: int = Field(
        -1,
        ge=-1,
        description="the prompt phase's deadline in ms from arrival (tokenbelt's first-token "
        "deadline; the request ends first_token_timeout); -1 or 0: none",
    )
    t_max_predict_ms: int = Field(
        -1,
        ge=-1,
        description="after this many ms from the first token, the next newline ends the "
        "completion (end reason total_timeout); -1 or 0: none",
    )
    samplers: list[str] | None = Field(
        None, max_length=16, description="accepted; tokenbelt samples in its own order"
    )
    cache_prompt: bool = Field(True, description="false: reuse no cached prefix")
    id_slot: int = Field(
        -1,
        ge=-1,
        description="the default supersede key: a newer request with the same id_slot ends "
        "this one (superseded); -1: none",
    )
    n_cmpl: int = Field(1, ge=1, le=MAX_CANDIDATES, description="candidates, decoded together")
    response_fields: list[str] | None = Field(
        None, max_length=64, description="only these fields (paths such as timings/prompt_n)"
    )
    stream: bool = False
    temperature: ranges.Temperature = None
    top_k: ranges.TopK = None
    top_p: ranges.TopP = None
    min_p: ranges.MinP = None
    seed: ranges.Seed = None
    stop: ranges.Stop = None
    repeat_penalty: ranges.RepeatPenalty = None
    repeat_last_n: int | None = Field(None, ge=-1, le=int(RANGES["max_tokens"].high))
    presence_penalty: ranges.Penalty = None
    frequency_penalty: ranges.Penalty = None
    ignore_eos: bool = False
    tokenbelt: TokenbeltOptions | None = None

    @property
    def warm_up(self) -> bool:
        """``n_predict: 0``: only the prompt, for the prefix cache (llama.vim's ring)."""
        return self.n_predict == 0

    def infill(self) -> Infill:
        extra = tuple((c.filename, c.text) for c in self.input_extra)
        return Infill(self.input_prefix, self.input_suffix, extra, self.prompt)

    def unknown_samplers(self) -> list[str]:
        return [s for s in self.samplers or () if s not in SAMPLERS]

    def sampling(self) -> dict[str, Any]:
        stop = self.stop
        return {
            "max_tokens": 1 if self.warm_up else (self.n_predict if self.n_predict > 0 else None),
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": [stop] if isinstance(stop, str) else stop,
            "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": self.repeat_last_n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
        }

    def options(self) -> TokenbeltOptions:
        """tokenbelt's options with ``t_max_prompt_ms`` as the first-token deadline (the
        sooner of it and ``tokenbelt.first_token_timeout``); a warm-up has none."""
        given = self.tokenbelt or TokenbeltOptions.model_validate({})
        if self.warm_up or self.t_max_prompt_ms <= 0:
            return given
        prompt_s = self.t_max_prompt_ms / 1000
        first = given.first_token_timeout
        first = prompt_s if first is None else min(first, prompt_s)
        return given.model_copy(update={"first_token_timeout": first})
