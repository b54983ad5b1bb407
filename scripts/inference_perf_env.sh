#!/usr/bin/env bash
# A virtual environment of its own, .venv-inference-perf, with inference-perf (the Gateway API
# Inference Extension's and llm-d's benchmark tool). It needs Python >= 3.12, newer than the
# project's, so it takes pyenv's 3.12 when present. bench/live/peer_clients.py runs it against the
# gateway. Idempotent: a stamp skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KAIROS_INFERENCE_PERF_VENV:-.venv-inference-perf}
SPEC=${KAIROS_INFERENCE_PERF_SPEC:-"inference-perf==0.7.0"}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(ls -d /root/.pyenv/versions/3.1[2-9]*/bin/python 2>/dev/null | head -1 || true)
  PYTHON=${PYTHON:-python3.12}
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
  || { echo "kairos: inference-perf needs Python >= 3.12; set PYTHON= to one" >&2; exit 1; }

. scripts/_venv.sh
ensure_venv "$VENV" "$SPEC" "$PYTHON"
