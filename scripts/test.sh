#!/usr/bin/env bash
# Tests: set up .venv if needed, then run pytest (arguments go to pytest).
# pytest exits 5 when it collects no test, so an empty run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
