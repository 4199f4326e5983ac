#!/usr/bin/env bash
# Set everything up, then run the whole test suite (slow real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra "$@"
