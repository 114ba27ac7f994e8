"""The house's rules (docs/house.md), held by the suite: every module under src/tokenbelt.

1. Size: a module is at most 600 lines.
2. Size: a function or method is at most 120 lines (``end_lineno - lineno + 1`` of its
   ``def``, decorators not counted); a nested function counts within its parent and on
   its own.
3. The face: code outside a package imports only that package's face (its
   ``__init__.py``). Exactly: an import, relative or absolute, run time or under
   ``TYPE_CHECKING``, whose target is a private module (a name part ``_x``, not a dunder)
   of package ``Q`` (the parts before ``_x``) is allowed only in a module whose own
   package is ``Q`` or lies inside ``Q``. So modules of a package import their siblings'
   private modules and their ancestors' (``from .._errors import``), and nothing else's:
   ``from ..belt._reasons import`` in ``_errors.py`` and ``from .llama._batch import`` in
   ``engines/_factory.py`` are past a face, as is ``from ..openai import _tools`` (a
   module imported by name). A package's own ``__init__.py`` is inside that package.
   Private names that are not modules (``from ._registry import _lock``) are not this
   rule's.
4. Floors: a module imports, at run time, nothing from a higher floor. The floors: 0
   ``_errors.py``, ``_defaults.py``, ``_heap.py``; 1 ``belt``; 2 ``engines``; 3
   ``models``; 4 ``runtime``; 5 ``server``, ``cli``. Run time is everywhere but the
   body of ``if TYPE_CHECKING:`` (functions' own imports count). ``tokenbelt/__init__.py``
   and ``__main__.py`` are on no floor: they re-export and run everything. A name taken
   from the top package counts as the floor of the module it re-exports it from; one it
   defines itself (``__version__``) is on no floor (every import loads the top first).
   A top-level module on no floor is itself a violation.

Exceptions live in ``EXCEPTIONS`` only, each with its reason, keyed (paths relative to
``src/tokenbelt/``) by ``path`` (a long module), ``path::Qualified.name`` (a long
function) or ``path -> tokenbelt.target.module`` (an import: excuses the face and floor
rules for every import of that target in that file). An exception that matches no
violation fails too, so the list cannot outlive the reasons in it.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from textwrap import dedent, indent

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tokenbelt"

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120

FLOORS = {
    "_errors": 0,
    "_defaults": 0,
    "_heap": 0,
    "belt": 1,
    "engines": 2,
    "models": 3,
    "runtime": 4,
    "server": 5,
    "cli": 5,
}
#: Top-level modules on no floor: the SDK's face re-exports every floor; ``-m`` runs the CLI.
OFF_THE_FLOORS = frozenset({"__init__", "__main__"})

RESPONSES_PLANS_WITH_OPENAI = (
    "docs/house.md: responses is OpenAI's second API and plans its requests with "
    "openai._tools (the same prompt, grammar and call parsing as /v1/chat/completions)"
)

#: The one place the house's rules are excused: key (see the docstring) -> reason.
EXCEPTIONS: dict[str, str] = {
    "server/responses/_routes.py -> tokenbelt.server.openai._tools": RESPONSES_PLANS_WITH_OPENAI,
    "server/responses/_tools.py -> tokenbelt.server.openai._tools": RESPONSES_PLANS_WITH_OPENAI,
}


@dataclass(frozen=True)
class Violation:
    key: str
    path: Path
    line: int
    rule: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.rule} [{self.key}]"


@dataclass(frozen=True)
class Module:
    path: Path
    name: str  # dotted: tokenbelt.engines.llama._batch
    package: str  # the package it is in: tokenbelt.engines.llama (itself, for __init__)
    key: str  # its path under src/tokenbelt
    tree: ast.Module
    lines: int


@dataclass(frozen=True)
class Import:
    target: str  # the module imported: tokenbelt.belt._reasons
    names: tuple[str, ...]  # the names taken from it (empty for ``import x``)
    line: int
    run_time: bool  # False under ``if TYPE_CHECKING:``


def _module(path: Path, text: str) -> Module:
    parts = ("tokenbelt", *path.relative_to(PACKAGE).with_suffix("").parts)
    is_face = parts[-1] == "__init__"
    name = ".".join(parts[:-1] if is_face else parts)
    return Module(
        path=path,
        name=name,
        package=name if is_face else name.rpartition(".")[0],
        key=path.relative_to(PACKAGE).as_posix(),
        tree=ast.parse(text, filename=str(path)),
        lines=len(text.splitlines()),
    )


@functools.cache
def modules() -> tuple[Module, ...]:
    return tuple(
        _module(path, path.read_text(encoding="utf-8")) for path in sorted(PACKAGE.rglob("*.py"))
    )


@functools.cache
def module_names() -> frozenset[str]:
    return frozenset(module.name for module in modules())


def _blocks(node: ast.AST) -> Iterator[list[ast.stmt]]:
    """The statement lists right inside ``node`` (if, try, with, match, def, class...)."""
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        children = getattr(node, field, None)
        if not isinstance(children, list):
            continue
        statements = [child for child in children if isinstance(child, ast.stmt)]
        if statements:
            yield statements
        for child in children:
            if isinstance(child, ast.ExceptHandler | ast.match_case):
                yield child.body


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(
    nodes: list[ast.stmt], run_time: bool = True
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement in ``nodes``, at any depth, and whether it runs."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, run_time
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.body, run_time=False)
            yield from _statements(node.orelse, run_time)
        else:
            for block in _blocks(node):
                yield from _statements(block, run_time)


def imports(module: Module) -> Iterator[Import]:
    """The tokenbelt modules ``module`` imports: a name that is a module is its target."""
    for node, run_time in _statements(module.tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tokenbelt":
                    yield Import(alias.name, (), node.lineno, run_time)
            continue
        if node.level:
            package = module.package.split(".")
            base = package[: len(package) - node.level + 1]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        if source.split(".")[0] != "tokenbelt":
            continue
        taken = []
        for alias in node.names:
            if f"{source}.{alias.name}" in module_names():
                yield Import(f"{source}.{alias.name}", (), node.lineno, run_time)
            else:
                taken.append(alias.name)
        if taken:
            yield Import(source, tuple(taken), node.lineno, run_time)


def _floor(name: str) -> int | None:
    """The floor of module ``name`` (dotted, under tokenbelt), None if on no floor."""
    return FLOORS.get(name.split(".")[1]) if "." in name else None


@functools.cache
def top_reexports() -> dict[str, str]:
    """Names the top package re-exports -> the module each comes from."""
    top = next(m for m in modules() if m.key == "__init__.py")
    return {name: i.target for i in imports(top) for name in i.names}


def _target_floors(imported: Import) -> Iterator[tuple[str, int]]:
    if imported.target != "tokenbelt":
        floor = _floor(imported.target)
        if floor is not None:
            yield imported.target, floor
        return
    for name in imported.names:  # from the top: the floor each name comes from
        origin = top_reexports().get(name)
        floor = _floor(origin) if origin else None
        if origin and floor is not None:
            yield origin, floor


def _functions(
    nodes: list[ast.stmt], prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in ``nodes`` at any depth, with its qualified name."""
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node.body, f"{name}.")
        else:
            for block in _blocks(node):
                yield from _functions(block, prefix)


def long_module(m: Module) -> Iterator[Violation]:
    if m.lines > MAX_MODULE_LINES:
        rule = f"{m.lines} lines: a module is at most {MAX_MODULE_LINES}"
        yield Violation(m.key, m.path, 1, rule)


def long_functions(m: Module) -> Iterator[Violation]:
    for name, node in _functions(m.tree.body):
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            rule = f"{name} is {length} lines: a function is at most {MAX_FUNCTION_LINES}"
            yield Violation(f"{m.key}::{name}", m.path, node.lineno, rule)


def past_the_face(m: Module) -> Iterator[Violation]:
    for i in imports(m):
        parts = i.target.split(".")
        for at, part in enumerate(parts[1:], start=1):
            owner = ".".join(parts[:at])
            private = part.startswith("_") and not part.startswith("__")
            if private and not (m.package == owner or m.package.startswith(f"{owner}.")):
                rule = f"imports {i.target}, past the face of {owner}: import from {owner}"
                yield Violation(f"{m.key} -> {i.target}", m.path, i.line, rule)
                break


def up_the_floors(m: Module) -> Iterator[Violation]:
    if m.path.parent == PACKAGE and m.path.stem in OFF_THE_FLOORS:
        return
    own = _floor(m.name)
    if own is None:
        yield Violation(m.key, m.path, 1, f"{m.key} is on no floor of docs/house.md")
        return
    for i in imports(m):
        if not i.run_time:
            continue
        for target, floor in _target_floors(i):
            if floor > own:
                rule = (
                    f"imports {target} (floor {floor}) at run time from floor {own}: "
                    "a floor imports only the floors below it"
                )
                yield Violation(f"{m.key} -> {target}", m.path, i.line, rule)


RULES = (long_module, long_functions, past_the_face, up_the_floors)


@functools.cache
def violations(rule: Callable[[Module], Iterator[Violation]]) -> tuple[Violation, ...]:
    return tuple(v for m in modules() for v in rule(m))


def _check(rule: Callable[[Module], Iterator[Violation]]) -> None:
    unexcused = [str(v) for v in violations(rule) if v.key not in EXCEPTIONS]
    if unexcused:
        pytest.fail("\n".join(unexcused), pytrace=False)


def test_modules_are_at_most_600_lines() -> None:
    _check(long_module)


def test_functions_are_at_most_120_lines() -> None:
    _check(long_functions)


def test_code_outside_a_package_imports_only_its_face() -> None:
    _check(past_the_face)


def test_a_floor_imports_only_the_floors_below_it_at_run_time() -> None:
    _check(up_the_floors)


def test_every_exception_is_still_needed() -> None:
    excused = {v.key for rule in RULES for v in violations(rule)}
    stale = [
        f"tests/test_house.py: EXCEPTIONS[{key!r}] excuses nothing now: remove it"
        for key in EXCEPTIONS
        if key not in excused
    ]
    if stale:
        pytest.fail("\n".join(stale), pytrace=False)


def test_every_top_level_module_is_on_a_floor() -> None:
    tops = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")
    }
    assert tops <= set(FLOORS) | OFF_THE_FLOORS


def _keys(rule: Callable[[Module], Iterator[Violation]], key: str, source: str) -> list[str]:
    """What ``rule`` finds in ``source`` as if it were the module at ``key``."""
    return [v.key for v in rule(_module(PACKAGE / key, dedent(source)))]


def test_the_face_rule_sees_each_shape() -> None:
    hidden = """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .belt._reasons import EndReason
    """
    assert _keys(past_the_face, "_errors.py", hidden) == ["_errors.py -> tokenbelt.belt._reasons"]
    assert _keys(past_the_face, "_errors.py", "from .belt import EndReason") == []
    factory = "engines/_factory.py"
    into_llama = f"{factory} -> tokenbelt.engines.llama._batch"
    assert _keys(past_the_face, factory, "from .llama._batch import BatchEngine") == [into_llama]
    assert _keys(past_the_face, factory, "from .llama import _batch") == [into_llama]
    assert _keys(past_the_face, factory, "import tokenbelt.engines.llama._batch") == [into_llama]
    inside = "from .llama import BatchEngine\nfrom ._request import Piece\nfrom .._errors import E"
    assert _keys(past_the_face, factory, inside) == []
    assert _keys(past_the_face, "engines/llama/__init__.py", "from ._batch import B") == []
    assert _keys(past_the_face, "engines/llama/_single.py", "from .._request import P") == []
    lazy = "def f():\n    from ..runtime._memory import DEFAULT_SHARE"
    assert _keys(past_the_face, "cli/_serve.py", lazy) == [
        "cli/_serve.py -> tokenbelt.runtime._memory"
    ]


def test_the_floor_rule_counts_run_time_only() -> None:
    up = "_errors.py -> tokenbelt.belt"
    assert _keys(up_the_floors, "_errors.py", "from .belt import EndReason") == [up]
    hidden = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .belt import EndReason"
    assert _keys(up_the_floors, "_errors.py", hidden) == []
    lazy = "def f():\n    from ..runtime import Runtime"
    assert _keys(up_the_floors, "belt/_x.py", lazy) == ["belt/_x.py -> tokenbelt.runtime"]
    assert _keys(up_the_floors, "belt/_x.py", "from .. import Runtime") == [
        "belt/_x.py -> tokenbelt.runtime"
    ]
    assert _keys(up_the_floors, "cli/_x.py", "from .. import __version__") == []
    assert _keys(up_the_floors, "models/_x.py", "from ..engines import BatchEngine") == []
    assert _keys(up_the_floors, "_new.py", "") == ["_new.py"]


def test_the_length_rule_counts_a_nested_function_twice() -> None:
    body = "\n".join(["def outer():", "    def inner():", *(["        pass"] * 120)])
    assert _keys(long_functions, "x.py", f"class C:\n{indent(body, '    ')}") == [
        "x.py::C.outer",
        "x.py::C.outer.inner",
    ]
    assert _keys(long_functions, "x.py", "\n".join(["def f():", *(["    pass"] * 119)])) == []
