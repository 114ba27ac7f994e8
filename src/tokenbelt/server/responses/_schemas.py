"""Request bodies of ``POST /v1/responses``, validated with pydantic.

Every field the API defines that tokenbelt acts on is declared; the few that mean
nothing to a local server are accepted and named as such; anything else is a 400
naming it (``extra="forbid"``), so a parameter is never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from ..core import TokenbeltOptions, ranges

#: a content part is checked by hand (``_items``), so an image says "no vision"
Content = str | list[dict[str, Any]]
Status = Literal["in_progress", "completed", "incomplete"]


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MessageItem(_Item):
    """A turn: a string or a list of parts (``input_text``, ``output_text``, ``refusal``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = Field(None, max_length=256)
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Item):
    """A call the model made earlier, sent back with the conversation (``namespace``:
    the ``namespace`` tool that holds the function, as this server names it)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    namespace: str | None = Field(None, max_length=64)
    id: str | None = Field(None, max_length=256)
    status: Status | None = None


class FunctionCallOutputItem(_Item):
    """A function's result, answering the call ``call_id``; without one (Codex sends
    its own tools' results so), the latest unanswered call of ``name`` (and
    ``namespace``) before it (``_items``)."""

    type: Literal["function_call_output"]
    call_id: str | None = Field(None, min_length=1, max_length=256)
    output: Content
    name: str | None = Field(None, min_length=1, max_length=64)
    namespace: str | None = Field(None, max_length=64)
    id: str | None = Field(None, max_length=256)
    status: Status | None = None


class ReasoningItem(_Item):
    """A thinking model's reasoning from an earlier turn, sent back with the conversation:
    taken, and left out of the prompt (as thinking models' templates drop it)."""

    type: Literal["reasoning"]
    id: str | None = Field(None, max_length=256)
    summary: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    content: list[dict[str, Any]] | None = Field(None, max_length=64)
    encrypted_content: str | None = None
    status: Status | None = None


class OtherItem(BaseModel):
    """Any other item type: answered with a 400 naming it (``_items``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    known = ("message", "function_call", "function_call_output", "reasoning")
    return kind if kind in known else "other"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    """A function the model may call (Responses tools are flat: no ``function`` object)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="always enforced: the grammar is strict")


class NamespaceTool(BaseModel):
    """A ``namespace``: functions grouped under a name (Codex's sub-agent tools); each
    is offered to the model as a function, and a call of one names its namespace."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    tools: list[FunctionTool] = Field(max_length=128)


class OtherTool(BaseModel):
    """A built-in tool type (web search, image generation...), which a local server
    cannot run: left out and named in ``tokenbelt.skipped_tools``, or refused with a
    400 naming it (``--responses-builtin-tools refuse``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str


def _tool_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace") else "other"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[OtherTool, Tag("other")],
    Discriminator(_tool_type),
]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedFunction


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON that matches a schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="always enforced: the grammar is strict")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None
    verbosity: str | None = Field(
        None, description="only medium: the model's length is set by max_output_tokens"
    )

    @field_validator("verbosity")
    @classmethod
    def _medium(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise ValueError(
                f"got {value!r}: tokenbelt has no verbosity levels (only 'medium' is taken); "
                "bound a reply's length with max_output_tokens"
            )
        return value


class Reasoning(BaseModel):
    """``reasoning``: a thinking model's effort; its reasoning comes whole (a reasoning
    item's ``reasoning_text``), so a summary asked for is that text, not a summary."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["none", "low", "medium", "high"] | None = Field(
        None,
        description="none: a thinking model answers at once; low, medium and high go to a "
        "chat template that reads an effort level (else a 400); a model without a thinking "
        "phase takes none only",
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="accepted: the reasoning comes whole, as reasoning_text"
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="accepted: the reasoning comes whole, as reasoning_text"
    )

    def think(self) -> bool | str | None:
        """The runtime's ``think`` for this effort."""
        if self.effort is None:
            return None
        return False if self.effort == "none" else self.effort


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_obfuscation: bool | None = Field(
        None, description="accepted, no effect: a local stream is not padded"
    )


class ResponseRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="a loaded model's alias; default: the first")
    input: str | list[Item] = Field(description="a string (one user turn) or a list of items")
    instructions: str | None = Field(
        None, description="a system turn before the input (not carried to a later response)"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = Field(
        None,
        description="keep the response for previous_response_id and GET: needs the server's "
        "store (--responses-store); default: true with the store, false without",
    )
    background: bool = Field(False, description="run detached; needs the store")
    previous_response_id: str | None = Field(None, max_length=256)
    max_output_tokens: int | None = ranges.bounded("max_tokens")
    temperature: ranges.Temperature = None
    top_p: ranges.TopP = None
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="minus this for every token generated at least once"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="minus this times how often a token was generated"
    )
    top_logprobs: int | None = Field(None, description="only 0: none")
    text: TextConfig | None = None
    reasoning: Reasoning | None = Field(
        None, description="a thinking model's effort (reasoning items come in the output)"
    )
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="accepted; a reply makes at most one call"
    )
    max_tool_calls: int | None = Field(
        None, ge=1, description="accepted: a reply makes at most one call (the answer says 1)"
    )
    truncation: Literal["auto", "disabled"] | None = Field(
        None,
        description="auto: the conversation's oldest items are left out when it outgrows "
        "the context window; disabled (the default): an input that does not fit is a 400",
    )
    include: list[str] | None = Field(
        None, max_length=16, description="only reasoning.encrypted_content (there is none)"
    )
    metadata: dict[str, str] | None = Field(None, max_length=16)
    client_metadata: dict[str, Any] | None = Field(
        None, max_length=64, description="accepted, no effect: the client's own bookkeeping"
    )
    user: str | None = Field(None, description="accepted, no effect")
    safety_identifier: str | None = Field(None, description="accepted, no effect")
    service_tier: str | None = Field(
        None, description="accepted: one tier here (the answer says 'default')"
    )
    prompt_cache_key: str | None = Field(
        None,
        description="accepted: the prefix cache is always on and matches the prompt itself, "
        "so a repeated prefix is reused whatever the key",
    )
    prompt_cache_retention: str | None = Field(None, description="accepted, no effect")
    # tokenbelt's own (an extra-body field for the openai SDK)
    seed: ranges.Seed = None
    stop: ranges.Stop = None
    tokenbelt: TokenbeltOptions | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError(
                f"got {value}: tokenbelt returns no log probabilities on /v1/responses (only "
                "0 is taken); /v1/chat/completions returns them (logprobs, top_logprobs)"
            )
        return value
