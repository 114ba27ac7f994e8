"""Thread counts for llama.cpp, chosen for the cores this process may use.

llama-cpp-python defaults to half the cores for decoding and all of them for
prompts. Measured on a 2-core machine with the default model (``benchmarks/batch.py``
sweeps the counts): decoding with 2 threads ran ~1.9x the rate of 1 thread, so
half the cores leaves about half the machine unused. tokenbelt uses every core
this process is allowed to run on (its CPU affinity, so a container or a
``taskset`` limit is respected) for both.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (CPU affinity where the OS has it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def default_threads() -> tuple[int, int]:
    """(decode threads, prompt threads) for this machine."""
    cores = usable_cores()
    return cores, cores
