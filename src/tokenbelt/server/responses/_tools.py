"""A request's ``tools`` as the functions the model is offered.

``function`` tools are offered as they are; a ``namespace`` tool's functions are offered
one by one, under their own names, and a call of one names its namespace (as the client
that sent it routes it). When the prompt would not fit the context with a namespace's
functions, the namespace is left out instead (Codex's sub-agent tools are ~2,600 tokens
of its ~9,100 on the default model): named in ``tokenbelt.skipped_namespaces`` and the
log, and the request goes on with the rest.

Every other type is a built-in tool that runs on OpenAI's side (``web_search``,
``image_generation``, ``file_search``...): a local server cannot run it. By default
such a tool is left out, and said so: its type is named in the response's
``tokenbelt.skipped_tools`` and in the log. With ``--responses-builtin-tools refuse``
the request is a 400 that names every such type at once (the types named by
``--responses-skip-tool`` are still left out).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import UnsupportedParameter
from ..openai import _tools
from ._schemas import FunctionTool, NamespaceTool, Tool

logger = logging.getLogger("tokenbelt.server")

#: what ``--responses-builtin-tools`` may say
BUILTIN_TOOLS = ("skip", "refuse")


@dataclass
class Offered:
    """The functions a request offers the model, and what it left out."""

    specs: list[_tools.ToolSpec] = field(default_factory=list)
    #: function name -> the ``namespace`` tool it came from
    namespaces: dict[str, str] = field(default_factory=dict)
    #: the built-in tool types left out, in the order the request named them
    skipped: list[str] = field(default_factory=list)
    #: the ``namespace`` tools left out because the prompt did not fit with them
    unfitted: list[str] = field(default_factory=list)

    def add(self, tool: FunctionTool, where: str, namespace: str | None = None) -> None:
        if any(spec.function.name == tool.name for spec in self.specs):
            raise UnsupportedParameter(
                f"{where}.name",
                f"{tool.name!r} names two tools (a namespace's functions are offered by "
                "their own names, so each name may be used once)",
            )
        fn = _tools.FunctionSpec(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        self.specs.append(_tools.ToolSpec(type="function", function=fn))
        if namespace is not None:
            self.namespaces[tool.name] = namespace

    def without_namespaces(self) -> Offered:
        """These functions less those of ``namespace`` tools, each such tool named."""
        return Offered(
            [spec for spec in self.specs if spec.function.name not in self.namespaces],
            {},
            [*self.skipped, *(["namespace"] if "namespace" not in self.skipped else [])],
            sorted(set(self.namespaces.values())),
        )

    def said(self) -> dict[str, Any]:
        """For the response's ``tokenbelt``: what was left out."""
        out: dict[str, Any] = {}
        if self.skipped:
            out["skipped_tools"] = self.skipped
        if self.unfitted:
            out["skipped_namespaces"] = self.unfitted
        return out

    def say_skipped(self, request_id: str, context: int) -> None:
        """Log what was left out of the request ``request_id`` (``context``: tokens)."""
        builtin = [kind for kind in self.skipped if kind != "namespace" or not self.unfitted]
        if builtin:
            logger.info(
                "%s: built-in tools left out (a local server cannot run them): %s",
                request_id,
                ", ".join(builtin),
            )
        if self.unfitted:
            logger.info(
                "%s: namespace tools left out (with their functions the prompt does not fit "
                "the %d-token context): %s",
                request_id,
                context,
                ", ".join(self.unfitted),
            )


def offered(tools: Sequence[Tool], policy: str, skip: tuple[str, ...]) -> Offered:
    """The functions of ``tools``; built-in types are left out, or refused by name when
    ``policy`` is ``refuse`` and their type is not in ``skip``."""
    out = Offered()
    refused: dict[str, int] = {}  # type -> its first index
    for i, tool in enumerate(tools):
        if isinstance(tool, FunctionTool):
            out.add(tool, f"tools.{i}")
        elif isinstance(tool, NamespaceTool):
            for j, inner in enumerate(tool.tools):
                out.add(inner, f"tools.{i}.tools.{j}", tool.name)
        elif policy == "refuse" and tool.type not in skip:
            refused.setdefault(tool.type, i)
        elif tool.type not in out.skipped:
            out.skipped.append(tool.type)
    if refused:
        kinds = ", ".join(repr(kind) for kind in refused)
        flags = " ".join(f"--responses-skip-tool {kind}" for kind in refused)
        raise UnsupportedParameter(
            f"tools.{min(refused.values())}.type",
            f"tools of type {kinds}: built-in tools run on OpenAI's side and this server "
            "runs function tools only; leave them out of the request, or start the server "
            f"without --responses-builtin-tools refuse (or with {flags}) to have them left "
            "out and named in tokenbelt.skipped_tools",
        )
    return out
