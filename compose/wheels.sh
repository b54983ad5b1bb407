#!/usr/bin/env bash
# Wheels of kairos-gateway's dependencies (and the build backend) in compose/wheels/, for building
# compose/Dockerfile without a package index: the image then installs the project from source
# with `pip install --no-index --find-links` (see the Dockerfile). Uses this machine's pip and its
# configuration (index, find-links, constraints). Skipped while pyproject.toml and this script are unchanged.
#
#   compose/wheels.sh [PYTHON]          # default .venv/bin/python (same CPython minor as the image)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$root/.venv/bin/python}
out=$root/compose/wheels
stamp=$out/.pyproject.sha256
want=$(cat "$root/pyproject.toml" "$0" | sha256sum | cut -c1-64)  # what to fetch: the dependencies and this list
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "compose/wheels: up to date"
  exit 0
fi
rm -f "$out"/*.whl "$stamp"
# async-timeout: redis needs it below Python 3.11.3 (Debian bookworm's python3 is 3.11.2), a marker
# this machine's newer 3.11 skips. pip's output only on failure (it warns about every package).
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$py" -m pip wheel -q --wheel-dir "$out" "$root" "setuptools>=68" wheel "async-timeout>=4.0.3" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
rm -f "$out"/kairos_gateway-*.whl  # the image builds the project from its source, never a stale wheel
echo "$want" > "$stamp"
echo "compose/wheels: $(ls "$out"/*.whl | wc -l) wheels"
