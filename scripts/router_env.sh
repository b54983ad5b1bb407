#!/usr/bin/env bash
# A virtual environment of its own, .venv-router, with vLLM's Rust router (vllm-router), the peer
# that bench/pd_paths.py puts beside Kairos on the P/D path. Never a Kairos dependency.
# Idempotent: a stamp skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KAIROS_ROUTER_VENV:-.venv-router}
SPEC=${KAIROS_ROUTER_SPEC:-"vllm-router==0.1.17"}
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.kairos-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$SPEC" ]; then
  echo "kairos: installing $SPEC into $VENV" >&2
  # shellcheck disable=SC2086 # the spec is a list of requirements
  "$VENV/bin/python" -m pip install -q $SPEC
  echo "$SPEC" > "$stamp"
fi
