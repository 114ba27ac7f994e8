"""The public surface is what we meant it to be (httpx's test_exported_members)."""

from __future__ import annotations

import sys

import tokenbelt

EXPECTED = {
    "DEFAULT_ALIAS",
    "AdmissionError",
    "Belt",
    "BeltStatistics",
    "Cancelled",
    "CatalogError",
    "ChatSession",
    "DecodeError",
    "DownloadCancelled",
    "DownloadError",
    "EndOfStream",
    "EndReason",
    "EngineError",
    "GenerationRequest",
    "IllegalState",
    "IntegrityError",
    "InvalidArgument",
    "Limits",
    "LlamaEngine",
    "LoadTimeout",
    "Model",
    "ModelError",
    "ModelLoadError",
    "ModelLoading",
    "ModelState",
    "PromptTooLong",
    "QueueFull",
    "RemoteEngine",
    "Reply",
    "Runtime",
    "RuntimeClosed",
    "SamplingParams",
    "SchedulerStatistics",
    "ScriptedEngine",
    "Stream",
    "TokenLogprob",
    "TokenbeltError",
    "Tool",
    "ToolCall",
    "Trace",
    "TraceEvent",
    "UnknownModel",
    "Upstream",
    "UpstreamError",
    "UpstreamUnavailable",
    "Usage",
    "WorkerCrashed",
    "__version__",
}


def test_all_is_exactly_the_intended_surface() -> None:
    assert set(tokenbelt.__all__) == EXPECTED


def test_all_is_sorted_and_resolvable() -> None:
    assert list(tokenbelt.__all__) == sorted(
        tokenbelt.__all__, key=lambda n: (n != "DEFAULT_ALIAS", n)
    )
    for name in tokenbelt.__all__:
        assert hasattr(tokenbelt, name), name


def test_public_members_say_they_live_in_tokenbelt() -> None:
    for name in tokenbelt.__all__:
        member = getattr(tokenbelt, name)
        if isinstance(member, type):
            assert member.__module__.startswith("tokenbelt."), name


def test_every_error_is_a_tokenbelt_error() -> None:
    for name in tokenbelt.__all__:
        member = getattr(tokenbelt, name)
        if isinstance(member, type) and issubclass(member, Exception):
            assert issubclass(member, tokenbelt.TokenbeltError), name


def test_importing_tokenbelt_stays_light() -> None:
    """The engine binding and the web stack load only when used."""
    code = "import sys, tokenbelt; print('llama_cpp' in sys.modules, 'fastapi' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
