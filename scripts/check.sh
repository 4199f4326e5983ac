#!/usr/bin/env bash
# The static checks CI runs before the tests (also the pre-commit hook): lint, format, import
# contracts, import cycles and types. Uses the tools in .venv (scripts/setup.sh installs them).
#
#   bash scripts/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
step() { echo "check: $*"; }
step "ruff check";           "$BIN/ruff" check -q .
step "ruff format --check";  "$BIN/ruff" format --check -q .
step "import contracts";     "$BIN/lint-imports" --no-cache | tail -1
step "import cycles";        "$BIN/python" scripts/check_import_cycles.py
step "mypy";                 "$BIN/mypy" | tail -1
