#!/usr/bin/env bash
# Set everything up, run the static checks, then the whole test suite (slow real-model tests
# included; fast ones run first, see tests/conftest.py) with the 25 slowest tests listed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
exec .venv/bin/python -m pytest -q -ra --durations=25 "$@"
