#!/usr/bin/env bash
# Shared set-up for the README's commands: a Python >= 3.11 virtual environment in .venv with
# Kairos installed (editable) plus the extras named in $KAIROS_EXTRAS. Idempotent and quiet
# when nothing changed. Installs Debian packages it needs when run as root, else says which.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1 || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "kairos: needs Python >= 3.11 as '$PY' (on Debian: apt-get install python3)" >&2
  exit 1
fi

need_apt=()
"$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt+=("python3-venv")
for pkg in ${KAIROS_APT_PACKAGES:-}; do
  command -v "${pkg%%:*}" >/dev/null 2>&1 || need_apt+=("${pkg#*:}")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "kairos: installing ${need_apt[*]} with apt-get" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "kairos: missing Debian packages: ${need_apt[*]} (run: sudo apt-get install ${need_apt[*]})" >&2
    exit 1
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kairos-installed
want="$(cat pyproject.toml | sha256sum | cut -c1-16) ${KAIROS_EXTRAS:-dev}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[${KAIROS_EXTRAS:-dev}]"
  echo "$want" > "$stamp"
fi
