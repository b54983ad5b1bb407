#!/usr/bin/env bash
# The README's test command: set up .venv, then lint and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
KAIROS_EXTRAS=dev bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
