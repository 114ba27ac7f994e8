"""A fill-in-the-middle copy of the embedded model, for the completion tests and benchmark.

SmolLM2 has no FIM tokens, but its vocabulary holds unused specials: the ``gguf``
package's ``gguf_new_metadata`` names five of them the FIM prefix, suffix, middle,
repository and file-separator tokens (``<issue_start>``, ``<issue_comment>``,
``<issue_closed>``, ``<repo_name>``, ``<file_sep>``), and llama.cpp then reads them as
it reads a code model's. The copy is made once (about 5 s) and kept in tokenbelt's user
cache directory under the source file's hash, so later runs find it at once.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import platformdirs

from tokenbelt.models import default_model_path

#: the FIM tokens the copy declares: llama.cpp's name -> the token id it names
FIM_IDS = {"fim_pre": 8, "fim_suf": 9, "fim_mid": 10, "fim_rep": 3, "fim_sep": 5}


def fim_model(source: Path | None = None) -> Path:
    """The path of the FIM copy of ``source`` (the embedded model), made if missing."""
    source = Path(source or default_model_path())
    with source.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    cache = Path(platformdirs.user_cache_dir("tokenbelt", appauthor=False)) / "test-models"
    target = cache / f"{source.stem}-fim-{digest}.gguf"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    command = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(source), str(partial)]
    for name, token in FIM_IDS.items():
        command += ["--special-token-by-id", name, str(token)]
    subprocess.run(command, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    os.replace(partial, target)  # whole or absent, whichever test process gets there first
    return target
