#!/usr/bin/env bash
# Start tokenbelt on port 8765, run langchain-tests' standard chat-model tests against it,
# stop it. LC_PATH: where langchain-tests and its pytest plugins are installed (they are
# kept out of the project's environment: pytest-asyncio's warning fails strict suites).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${PYTHON:-python}
PYTHONPATH="$root/src" "$py" -c "import sys; from tokenbelt.cli import main; sys.argv=['tokenbelt','serve','--port','8765']; main()" &
server=$!
trap 'kill $server' EXIT
for _ in $(seq 120); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 1; done
PYTHONPATH="${LC_PATH:-}:$root/src" "$py" -m pytest -c /dev/null -p no:cacheprovider -q \
  -o asyncio_mode=auto -o asyncio_default_fixture_loop_scope=session -o asyncio_default_test_loop_scope=session "$here/test_standard.py" "$@"
