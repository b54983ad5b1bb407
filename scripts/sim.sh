#!/usr/bin/env bash
# A short simulator sweep of the P/D baseline against Kairos on the Bursty workload (2P2D,
# default profile): a table, out/sim.json and plots in out/plots. Extra arguments go to
# `kairos sim`.
set -euo pipefail
cd "$(dirname "$0")/.."
KAIROS_EXTRAS=dev bash scripts/bootstrap.sh
exec .venv/bin/kairos sim --workload bursty --policies pd,kairos:alpha=1.3 --rps 2,4,6,8 \
  --duration 600 --seed 1 --json out/sim.json --plots out/plots "$@"
