#!/usr/bin/env bash
# The README's main command: set up .venv (and redis-server), then run a local Kairos cluster:
# Envoy on :8000, Redis, the dispatcher, and emulated 2P2D vLLM nodes with their sidecars and
# heartbeat publishers. It prints a curl line to try; Ctrl-C stops everything. Extra
# arguments go to `kairos up` (e.g. --port 8080 --decode-nodes 4 --policy pd).
set -euo pipefail
cd "$(dirname "$0")/.."
KAIROS_EXTRAS=dev KAIROS_APT_PACKAGES="redis-server:redis-server" bash scripts/bootstrap.sh
exec .venv/bin/kairos up "$@"
