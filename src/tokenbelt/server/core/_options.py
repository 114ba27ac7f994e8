"""What tokenbelt itself accepts in every dialect: its extension object and the sampling ranges.

``TokenbeltOptions`` is the ``tokenbelt`` field of any request body (deadlines and belt
capacity for that one request; a field left out is the runtime's own value). The
sampling ranges are declared once, here, for every dialect whose body carries them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...belt import RANGES, Range

#: the longest per-request timeout: the range table's (a year), as the SDK's ``Limits``
MAX_TIMEOUT_S = RANGES["timeout"].high

#: HTTP field name -> its entry in the range table (``tokenbelt.belt.RANGES``), for the
#: fields whose name is not the table's own; a value out of range is refused naming it
FIELD_RANGES: dict[str, str] = {
    "max_completion_tokens": "max_tokens",
    "max_output_tokens": "max_tokens",
    "first_token_timeout": "timeout",
    "total_timeout": "timeout",
    "stall_timeout": "timeout",
    "reasoning_timeout": "timeout",
}


def range_of(field: str) -> Range | None:
    """The range an HTTP field of that name states, if the table has one."""
    return RANGES.get(FIELD_RANGES.get(field, field))


def bounded(name: str, default: Any = None, description: str | None = None) -> Any:
    """A pydantic ``Field`` with ``RANGES[name]``'s bounds, its range said in the
    OpenAPI description, so the document states what the SDK and the CLI accept."""
    limits = RANGES[name]
    said = f"{description}; {limits.text()}" if description else limits.text()
    return Field(default, **limits.bounds(), description=said)


#: the sampling ranges tokenbelt accepts, whichever dialect a value comes in
Temperature = Annotated[float | None, Field(ge=0, le=2)]
TopP = Annotated[float | None, Field(gt=0, le=1)]
TopK = Annotated[int | None, Field(**RANGES["top_k"].bounds())]
MinP = Annotated[float | None, Field(ge=0, le=1)]
RepeatPenalty = Annotated[float | None, Field(gt=0, le=10)]
#: OpenAI's frequency and presence penalties (Ollama takes them too)
Penalty = Annotated[float | None, Field(ge=-2, le=2)]
Seed = Annotated[int | None, Field(**RANGES["seed"].bounds())]
#: a stop string is never empty (an empty one would end every reply at once)
StopString = Annotated[str, Field(min_length=1)]
Stop = Annotated[StopString | list[StopString] | None, Field(max_length=16)]


class TokenbeltOptions(BaseModel):
    """tokenbelt's extension object: per-request deadlines, belt capacity and drafting."""

    model_config = ConfigDict(extra="forbid", strict=True)

    first_token_timeout: float | None = bounded(
        "timeout", description="seconds from enqueue to the first token"
    )
    total_timeout: float | None = bounded("timeout", description="seconds from enqueue to the end")
    stall_timeout: float | None = bounded(
        "timeout", description="longest gap between two tokens, seconds"
    )
    capacity: int | None = bounded(
        "capacity", description="how many tokens generation may run ahead of the reader"
    )
    reasoning_budget: int | None = bounded(
        "reasoning_budget",
        description="a thinking model's reasoning phase: at most this many tokens, then "
        "its end marker is forced and the answer starts (0: answer at once)",
    )
    reasoning_timeout: float | None = bounded(
        "timeout",
        description="seconds a thinking model may reason, from its first token; then its "
        "end marker is forced and the answer starts (the request goes on)",
    )
    draft: Literal["lookup", "off"] | None = Field(
        None,
        description="prompt-lookup drafting for this request (default: the server's "
        "--draft): lookup verifies tokens taken from the request's own earlier text in one "
        "step and stops where it does not pay; the text is the same either way",
    )
    supersede: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="a supersede key (an editor's buffer, say): a newer request with the "
        "same key (and the same API key) ends this one, queued or running, with the end "
        "reason superseded (also the X-Tokenbelt-Supersede header)",
    )
