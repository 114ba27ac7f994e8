"""A tokenbelt server of scripted engines in a process of its own (one a test can kill).

    python scripted_upstream.py PORT [TOKENS] [DELAY]

Serves the model ``scripted``: TOKENS pieces, DELAY seconds apart, two slots.
"""

from __future__ import annotations

import sys

import uvicorn

from tokenbelt import Runtime, ScriptedEngine
from tokenbelt.server import ServerSettings, create_app


def main() -> None:
    port = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.02
    runtime = Runtime(keep_alive=None, queue_size=8)
    engines = [ScriptedEngine([f" w{i}" for i in range(n)], delay=delay) for _ in range(2)]
    runtime.add_engines("scripted", engines)
    app = create_app(runtime, ServerSettings())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
