#!/usr/bin/env bash
# The README's test command: set up .venv (and redis-server), then lint and run every test,
# the end-to-end ones included (real Envoy, redis-server, gRPC, emulated vLLM nodes).
set -euo pipefail
cd "$(dirname "$0")/.."
KAIROS_EXTRAS=dev KAIROS_APT_PACKAGES="redis-server:redis-server" bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
