"""``tokenbelt serve A B`` with pins, per-model settings and a memory budget, and
``tokenbelt ps`` reading where each model stands; bad flags are one line each."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import plainhttp
from serving import free_port
from tokenbelt.cli import main as cli
from tokenbelt.models import default_model_path

from .test_first_contact import tokenbelt

NET = 60.0


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def aliases() -> list[str]:
    for alias in ("a", "b"):
        assert cli(["models", "add", str(default_model_path()), "--alias", alias]) == 0
    return ["a", "b"]


@contextlib.contextmanager
def serving(tmp_path: Path, *args: str) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "tokenbelt", "serve", *args, "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + NET
        while True:
            assert process.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if plainhttp.get(f"{url}/health", timeout=2).json()["status"] == "ok":
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(15)


@pytest.mark.model
def test_serve_two_aliases_with_a_pin_and_settings_and_ps_shows_them(
    tmp_path: Path, aliases: list[str]
) -> None:
    # 2 GiB for two models: their prefix caches at 4,096 tokens, not a gibibyte each
    flags = ("--memory-budget", "2GiB", "--cache-tokens", "4096", "--pin", "a")
    flags += ("--model", "b:slots=1,n_ctx=512")
    with serving(tmp_path, *aliases, *flags) as url:
        status = plainhttp.get(f"{url}/health", timeout=NET).json()["model_status"]
        assert status["a"]["state"] == "ready"
        assert status["a"]["pinned"]
        assert status["b"]["state"] == "idle_unloaded"
        assert status["b"]["slots"] == 1
        assert "not loaded yet" in status["b"]["unloaded_because"]
        body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert (
            plainhttp.post(f"{url}/v1/chat/completions", json=body, timeout=NET).status_code == 200
        )

        done = tokenbelt("ps", "--url", url)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].split()[:3] == ["MODEL", "STATE", "MEMORY"]
        rows = {line.split()[0]: line.split() for line in lines[1:-1]}
        assert rows["a"][1] == rows["b"][1] == "ready"
        assert "yes" in rows["a"]
        assert "yes" not in rows["b"]
        assert lines[-1].startswith("memory: ")
        assert "of 2048 MiB" in lines[-1]


def test_ps_without_a_server_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = tokenbelt("ps", "--url", url)
    assert done.returncode == 1
    assert error_line(done).startswith(f"tokenbelt: error: cannot reach {url}")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--model", "a:bogus=1"), "a: 'bogus=1' is not KEY=VALUE with a key of slots"),
        (("--model", "a"), "give ALIAS:KEY=VALUE"),
        (("--model", "a:slots=0"), "a: slots:"),
        (("--memory-budget", "lots"), "--memory-budget"),
        (("--pin", "c"), "--pin and --model name 'c', which is not served"),
    ],
)
def test_bad_model_flags_are_one_line(
    aliases: list[str], flags: tuple[str, ...], says: str
) -> None:
    done = tokenbelt("serve", *aliases, *flags, "--port", str(free_port()))
    assert done.returncode == 2
    assert says in error_line(done)


def test_all_models_serves_what_is_on_this_machine(tmp_path: Path, aliases: list[str]) -> None:
    from tokenbelt.cli._served import cached_aliases

    found = cached_aliases()
    # The aliases added from local files, and the embedded default model.
    assert {"a", "b", "smollm2-135m"} <= set(found)
    from tokenbelt.models import Catalog, Home

    catalog_only = "nomic-embed-text-v1.5"  # in the catalog, not downloaded here
    assert catalog_only in [e.alias for e in Catalog.load(Home.from_env())]
    assert catalog_only not in found


@pytest.mark.parametrize(
    ("text", "size"),
    [("1TB", 10**12), ("1TiB", 1 << 40), ("1.5GiB", 3 << 29), ("10", 10), ("500kB", 500_000)],
)
def test_sizes_take_every_unit_up_to_terabytes(text: str, size: int) -> None:
    from tokenbelt.cli._common import byte_size

    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["1G", "lots", "-5", "1XB", "GiB"])
def test_a_bad_size_says_what_a_size_is(text: str) -> None:
    import argparse

    from tokenbelt.cli._common import byte_size

    with pytest.raises(argparse.ArgumentTypeError, match=r"a size is a number of bytes|>= 0"):
        byte_size(text)
