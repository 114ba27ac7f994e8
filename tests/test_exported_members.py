"""The public surface is what we meant it to be (httpx's test_exported_members)."""

from __future__ import annotations

import inspect
import pickle
import sys
import types
import typing

import tokenbelt
from tokenbelt.engines import Piece

#: Engines that the runtime builds, and that ``Runtime.load`` returns inside a ``Model``.
LIVE_ENGINES = ("BatchEngine", "WorkerEngine")
#: Importable from their own packages, not from the top: the single-sequence engine is a
#: benchmark baseline now, and ``Belt`` holds both ends (readers get a ``Stream``, engines
#: a ``Producer``).
NOT_AT_THE_TOP = ("LlamaEngine", "Belt")


def _public(name: str) -> bool:
    return not name.startswith("_")


def test_all_is_sorted_and_resolvable() -> None:
    assert list(tokenbelt.__all__) == sorted(
        tokenbelt.__all__, key=lambda n: (n != "DEFAULT_ALIAS", n)
    )
    assert len(set(tokenbelt.__all__)) == len(tokenbelt.__all__)
    for name in tokenbelt.__all__:
        assert hasattr(tokenbelt, name), name


def test_every_public_attribute_is_in_all() -> None:
    """Nothing public hides outside ``__all__`` (submodules are packages, not members)."""
    attributes = {
        name
        for name, value in vars(tokenbelt).items()
        if _public(name) and not isinstance(value, types.ModuleType)
    }
    assert attributes == {name for name in tokenbelt.__all__ if _public(name)}


def test_the_engines_exported_are_the_ones_the_runtime_uses() -> None:
    for name in LIVE_ENGINES:
        assert name in tokenbelt.__all__
        assert getattr(tokenbelt, name) is getattr(tokenbelt.engines, name)
    for name in NOT_AT_THE_TOP:
        assert name not in tokenbelt.__all__
        assert not hasattr(tokenbelt, name), name
    assert tokenbelt.engines.LlamaEngine is not None
    assert tokenbelt.belt.Belt is not None


def test_public_members_say_they_live_in_tokenbelt() -> None:
    for name in tokenbelt.__all__:
        member = getattr(tokenbelt, name)
        if isinstance(member, type) or inspect.isfunction(member):
            assert member.__module__ == "tokenbelt", name
            assert member.__qualname__ == name, name


def test_every_public_class_pickles_by_its_public_name() -> None:
    """``pickle`` finds a class by ``__module__`` + ``__qualname__``: the rewrite must lead
    back to the same class, or the worker process could not unpickle a request."""
    for name in tokenbelt.__all__:
        member = getattr(tokenbelt, name)
        if isinstance(member, type):
            assert pickle.loads(pickle.dumps(member)) is member, name


def test_what_crosses_the_worker_pipe_round_trips() -> None:
    """The records pickled through the worker pipe, and the errors a turn may end with."""
    sampling = tokenbelt.SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=("\n",))
    logprob = tokenbelt.TokenLogprob("a", -0.5, b"a", (tokenbelt.TokenLogprob("b", -1.5, b"b"),))
    values: list[object] = [
        sampling,
        tokenbelt.GenerationRequest(
            messages=[{"role": "user", "content": "hi"}], sampling=sampling, tools="[]"
        ),
        tokenbelt.GenerationRequest(prompt="Once", conversation_id="c1"),
        logprob,
        Piece("a", (logprob,)),
        tokenbelt.EndReason.USER_CANCEL,
        tokenbelt.Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=1),
        tokenbelt.Limits(total=5.0),
    ]
    for value in values:
        back = pickle.loads(pickle.dumps(value))
        assert back == value, value
        assert type(back) is type(value)
    for error in (tokenbelt.WorkerCrashed("gone"), tokenbelt.PromptTooLong("long")):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error)
        assert str(back) == str(error)


def test_type_hints_of_public_classes_still_resolve() -> None:
    """``typing.get_type_hints`` reads ``__module__``'s globals; the rewrite keeps it
    working (pydantic and FastAPI call it on classes used as field types)."""
    for name in tokenbelt.__all__:
        member = getattr(tokenbelt, name)
        if isinstance(member, type):
            typing.get_type_hints(member)


def test_every_error_is_a_tokenbelt_error() -> None:
    for name in tokenbelt.__all__:
        member = getattr(tokenbelt, name)
        if isinstance(member, type) and issubclass(member, Exception):
            assert issubclass(member, tokenbelt.TokenbeltError), name


#: what ``import tokenbelt`` leaves unimported: the engine binding and the web stack load
#: when used, the HTTP clients when a process first downloads or speaks to an upstream
#: (together half the import time of every worker, CLI command and server)
LOADED_WHEN_USED = ("llama_cpp", "fastapi", "aiohttp", "httpx")


def test_importing_tokenbelt_stays_light() -> None:
    code = f"import sys, tokenbelt; print([m for m in {LOADED_WHEN_USED!r} if m in sys.modules])"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
