#!/usr/bin/env bash
# The README's test command (and CI's, .ci/run): set up .venv (and redis-server), lint, then run
# the tiers as two pytest runs, each with its own wall time:
#   1. tests/unit, tests/component, tests/e2e (real Envoy, redis-server, gRPC, emulated vLLM nodes),
#      tests/compose (compose/docker-compose.yml built and run on a dockerd of its own; required:
#      KAIROS_REQUIRE_COMPOSE=1, so a missing Docker fails instead of skipping);
#   2. tests/integration alone (real vLLM on CPU in .venv-vllm, built by scripts/vllm_env.sh;
#      required here, not skipped). Its two vLLM servers spin a core each for the whole session,
#      so nothing else runs beside them.
# Both runs happen even if the first fails; the script fails if either does.
#
# Extra arguments go to pytest. Paths among them pick the tiers: `scripts/test.sh tests/unit -x`
# runs tests/unit only; `scripts/test.sh tests/integration/test_vllm_node.py` the integration
# run only; options alone (`-x`, `-k word`) apply to both runs, and then a run that selects
# nothing ("no tests collected") is not a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

fast=() integration=() options=()
for arg in "$@"; do
  path=${arg%%::*}
  if [[ $arg != -* && -e $path ]]; then
    case "$(realpath -m --relative-to=. "$path")" in
      tests/integration | tests/integration/*) integration+=("$arg") ;;
      . | tests) ;;  # the whole suite: both runs, as with no path
      *) fast+=("$arg") ;;
    esac
  else
    options+=("$arg")
  fi
done
if ((${#fast[@]} + ${#integration[@]} == 0)); then
  fast=(tests --ignore=tests/integration)
  integration=(tests/integration)
fi

KAIROS_EXTRAS=dev KAIROS_APT_PACKAGES="redis-server:redis-server promtool:prometheus tmux:tmux dockerd:docker.io \
  debootstrap:debootstrap docker-compose:docker-compose" bash scripts/bootstrap.sh
require=()  # with .venv-vllm built, a test that needs it fails instead of skipping (both runs)
if ((${#integration[@]} > 0)); then
  bash scripts/vllm_env.sh
  bash scripts/inference_perf_env.sh  # tests/integration/test_peer_clients.py (Python >= 3.12)
  require=(KAIROS_REQUIRE_VLLM=1)
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .

failed=0
tier() {  # tier LABEL [ENV=VALUE...] -- PYTEST-ARGS...
  local label=$1 started rc=0
  shift
  local env=()
  while [[ $1 != -- ]]; do env+=("$1"); shift; done
  shift
  # The free disk, for a failure's log: the virtual environments (6 GB) are in by now, and the
  # compose tier's images take about 2.5 GB more (3.5 at peak); a shared disk may run out under them.
  local free_mb
  free_mb=$(df -Pm . | awk 'NR == 2 { print $4 }')
  echo "== $label: pytest $* ($(awk -v m="$free_mb" 'BEGIN { printf "%.1f", m / 1024 }') GB free on the disk)"
  if ((free_mb < 4096)); then
    echo "== warning: under 4 GB free; the compose tier's image builds need about 3.5 GB" >&2
  fi
  started=$EPOCHREALTIME
  env "${env[@]}" .venv/bin/python -m pytest -q "$@" || rc=$?
  if ((rc == 5 && ${#options[@]} > 0)); then rc=0; fi  # the options selected nothing in this tier
  awk -v s="$started" -v e="$EPOCHREALTIME" -v l="$label" -v rc="$rc" \
    'BEGIN { printf "== %s: %s in %.1f s\n", l, (rc == 0 ? "passed" : "FAILED (exit " rc ")"), e - s }'
  ((rc == 0)) || failed=1
}

((${#fast[@]} == 0)) || tier "unit + component + e2e + compose" "${require[@]}" KAIROS_REQUIRE_COMPOSE=1 -- "${fast[@]}" "${options[@]}"
((${#integration[@]} == 0)) || tier "integration (real vLLM)" KAIROS_REQUIRE_VLLM=1 -- "${integration[@]}" "${options[@]}"
exit "$failed"
