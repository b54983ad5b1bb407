#!/usr/bin/env bash
# A virtual environment of its own, .venv-router, with vLLM's Rust router (vllm-router), the peer
# that bench/micro/gateway_overhead.py puts beside Kairos on the P/D path. Never a Kairos dependency.
# Idempotent: a stamp skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KAIROS_ROUTER_VENV:-.venv-router}
SPEC=${KAIROS_ROUTER_SPEC:-"vllm-router==0.1.17"}
PYTHON=${PYTHON:-python3}

. scripts/_venv.sh
ensure_venv "$VENV" "$SPEC" "$PYTHON"
