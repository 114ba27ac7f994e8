"""What tokenbelt itself accepts in every dialect: its extension object and the sampling ranges.

``TokenbeltOptions`` is the ``tokenbelt`` field of any request body (deadlines and belt
capacity for that one request; a field left out is the runtime's own value). The
sampling ranges are declared once, here, for every dialect whose body carries them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# Long enough for any real use, short enough that a typo is caught.
MAX_TIMEOUT_S = 3600.0

#: the sampling ranges tokenbelt accepts, whichever dialect a value comes in
Temperature = Annotated[float | None, Field(ge=0, le=2)]
TopP = Annotated[float | None, Field(gt=0, le=1)]
TopK = Annotated[int | None, Field(ge=0, le=100_000)]
MinP = Annotated[float | None, Field(ge=0, le=1)]
RepeatPenalty = Annotated[float | None, Field(gt=0, le=10)]
Seed = Annotated[int | None, Field(ge=0, le=2**32 - 1)]
Stop = Annotated[str | list[str] | None, Field(max_length=16)]


class TokenbeltOptions(BaseModel):
    """tokenbelt's extension object: per-request deadlines and belt capacity."""

    model_config = ConfigDict(extra="forbid")

    first_token_timeout: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="seconds from enqueue to the first token"
    )
    total_timeout: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="seconds from enqueue to the end"
    )
    stall_timeout: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="longest gap between two tokens, seconds"
    )
    capacity: int | None = Field(
        None, ge=1, le=1024, description="how many tokens generation may run ahead of the reader"
    )
