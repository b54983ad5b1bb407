#!/usr/bin/env bash
# The README's test command: set up .venv (and redis-server), then lint and run every test,
# the end-to-end ones (real Envoy, redis-server, gRPC, emulated vLLM nodes) and the integration
# tier (real vLLM on CPU in .venv-vllm, built by scripts/vllm_env.sh; required here, not skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
KAIROS_EXTRAS=dev KAIROS_APT_PACKAGES="redis-server:redis-server" bash scripts/bootstrap.sh
bash scripts/vllm_env.sh
.venv/bin/ruff check .
KAIROS_REQUIRE_VLLM=1 exec .venv/bin/python -m pytest -q "$@"
