"""Fill-in-the-middle: what a completion between a prefix and a suffix asks (``Infill``),
and the ability of an engine whose vocabulary has the model's FIM tokens (``FillsMiddle``).

An engine that fills the middle makes the prompt from the model's own FIM tokens (as
llama.cpp reads them from the vocabulary) and hands back plain token ids: the request
then queues as any raw prompt of token ids does (prefix cache, deadlines, cancel).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .._errors import InvalidArgument
from ._request import check_text

#: the FIM tokens a vocabulary may have, by llama.cpp's names (``llama_vocab_fim_*``)
FIM_TOKENS = ("pre", "suf", "mid", "pad", "rep", "sep")
#: the ones a completion between a prefix and a suffix cannot do without
FIM_NEEDED = ("pre", "suf", "mid")
#: the orders a prompt may put the parts in: prefix-suffix-middle, suffix-prefix-middle
FIM_ORDERS = ("psm", "spm")
#: what each FIM token is called in errors and answers
FIM_NAMES = {
    "pre": "prefix",
    "suf": "suffix",
    "mid": "middle",
    "pad": "pad",
    "rep": "repository",
    "sep": "file separator",
}


@dataclass(frozen=True)
class Infill:
    """A completion between ``prefix`` and ``suffix`` (the text before and after the cursor).

    ``extra`` holds other files of the repository as ``(file name, text)`` pairs: put
    before the prefix in the repository layout (``<repo>project <file_sep>name ...``)
    when the vocabulary has those tokens, else between plain snippet separators.
    ``middle`` is text the completion continues from (llama.cpp's ``prompt``: the
    current line up to the cursor), put right after the prefix. ``order`` is ``psm``
    (prefix, suffix, middle) or ``spm`` (suffix first, for families trained so).
    ``project`` and ``filename`` name the repository and the current file in that layout.
    """

    prefix: str = ""
    suffix: str = ""
    extra: tuple[tuple[str, str], ...] = ()
    middle: str = ""
    order: str = "psm"
    project: str = "myproject"
    filename: str = "filename"

    def __post_init__(self) -> None:
        for name in ("prefix", "suffix", "middle", "project", "filename"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidArgument(
                    f"{name} must be a string, got {type(value).__name__}", param=name
                )
            check_text(name, value)
        if self.order not in FIM_ORDERS:
            raise InvalidArgument(
                f"order must be one of {', '.join(FIM_ORDERS)}, got {self.order!r}", param="order"
            )
        object.__setattr__(self, "extra", extra_files(self.extra))


def extra_files(extra: object) -> tuple[tuple[str, str], ...]:
    """``extra`` as ``(file name, text)`` pairs: pairs, or ``{"filename", "text"}`` dicts
    as llama.cpp's ``input_extra`` holds them; ``InvalidArgument`` for anything else."""
    if not isinstance(extra, Sequence) or isinstance(extra, str | bytes):
        raise InvalidArgument("extra is a list of (file name, text) pairs", param="extra")
    out: list[tuple[str, str]] = []
    for i, item in enumerate(extra):
        if isinstance(item, dict):
            name, text = item.get("filename", "tmp"), item.get("text", "")
        elif isinstance(item, tuple | list) and len(item) == 2:
            name, text = item
        else:
            raise InvalidArgument(
                f"extra[{i}] must be a (file name, text) pair, got {item!r}", param="extra"
            )
        if not isinstance(name, str) or not isinstance(text, str):
            raise InvalidArgument(
                f"extra[{i}]: the file name and text must be strings", param="extra"
            )
        check_text(f"extra[{i}]", name + text)
        out.append((name, text))
    return tuple(out)


@dataclass(frozen=True)
class InfillPrompt:
    """An infill's prompt tokens, and whether some of its text was left out to fit."""

    tokens: tuple[int, ...]
    #: part of the prefix, the suffix or the extra files was left out (llama.cpp's
    #: ``truncated``)
    truncated: bool


@runtime_checkable
class FillsMiddle(Protocol):
    """An engine that can make a fill-in-the-middle prompt from its model's vocabulary."""

    #: the FIM tokens its vocabulary has: a name of ``FIM_TOKENS`` -> token id
    fim_tokens: dict[str, int]

    def infill_prompt(self, infill: Infill, max_tokens: int) -> InfillPrompt:
        """The prompt of ``infill``, leaving room for ``max_tokens`` (blocking, cheap).
        Raises ``InvalidArgument`` when the vocabulary lacks a needed FIM token."""
        ...


def fim_missing(fim_tokens: dict[str, int]) -> list[str]:
    """The needed FIM tokens a vocabulary lacks, by their names (empty: it can fill)."""
    return [FIM_NAMES[part] for part in FIM_NEEDED if part not in fim_tokens]


def no_fim_reason(model: str, missing: Sequence[str]) -> str:
    """One line saying that ``model`` cannot fill in the middle, and why."""
    if not missing:
        return f"model {model} cannot fill in the middle here"
    return (
        f"model {model} cannot fill in the middle: its vocabulary has no FIM "
        f"{', '.join(missing)} token{'s' if len(missing) > 1 else ''} "
        "(a code model with FIM tokens can: qwen2.5-coder, starcoder2, codellama, ...)"
    )
