#!/usr/bin/env bash
# Main job: set up .venv if needed, then run vLLM with speculative decoding
# on the bundled pair. Extra arguments go to scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"
