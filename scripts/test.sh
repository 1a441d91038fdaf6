#!/usr/bin/env bash
# Tests: set up .venv if needed, then run pytest (arguments go to pytest).
# pytest exits 5 when it collects no test, so an empty run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# -P: do not put the current directory (the repo root) on sys.path, where
# triton_kernels/ would shadow the top-level name vLLM probes (DESIGN.md 5).
exec .venv/bin/python -P -m pytest "$@"
