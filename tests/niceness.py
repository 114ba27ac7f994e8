"""Each thread's niceness, read from /proc (Linux): what ``decode_nice`` changed."""

from __future__ import annotations

import os
from pathlib import Path


def niceness(pid: int) -> dict[int, int]:
    """Each thread of process ``pid`` and its niceness (a task's stat, field 19)."""
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[16])
    return out
