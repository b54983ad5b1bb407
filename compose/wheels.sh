#!/usr/bin/env bash
# Wheels of kairos-gateway's dependencies (and the build backend) in compose/wheels/, for building
# compose/Dockerfile without a package index: the image then builds the project's wheel and
# installs it with `pip install --no-index --find-links` (see the Dockerfile), as
# tests/e2e/test_installed_wheel.py does outside the repository. Uses this machine's pip and its
# configuration (index, find-links, constraints). Skipped while pyproject.toml and this script are
# unchanged; concurrent runs (the compose tier, the wheel test) take turns.
#
#   compose/wheels.sh [PYTHON]          # default .venv/bin/python (same CPython minor as the image)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$root/.venv/bin/python}
out=$root/compose/wheels
stamp=$out/.pyproject.sha256
exec 9>"$out/.lock"
flock 9
want=$(cat "$root/pyproject.toml" "$0" | sha256sum | cut -c1-64)  # what to fetch: the dependencies and this list
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "compose/wheels: up to date"
  exit 0
fi
rm -f "$out"/*.whl "$stamp"
# async-timeout: redis needs it below Python 3.11.3 (Debian bookworm's python3 is 3.11.2), a marker
# this machine's newer 3.11 skips. pip's output only on failure (it warns about every package).
# The requirements are pyproject.toml's, read rather than built: no wheel of the project (the image
# builds its own from the source) and no build/ left in the checkout.
log=$(mktemp)
reqs=$(mktemp)
trap 'rm -f "$log" "$reqs"' EXIT
"$py" - "$root/pyproject.toml" >"$reqs" <<'EOF_PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    p = tomllib.load(f)
print("\n".join(p["build-system"]["requires"] + p["project"]["dependencies"]))
EOF_PY
if ! "$py" -m pip wheel -q --wheel-dir "$out" -r "$reqs" wheel "async-timeout>=4.0.3" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "compose/wheels: $(ls "$out"/*.whl | wc -l) wheels"
