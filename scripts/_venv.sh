# Sourced by the scripts that build a benchmark's own virtual environment (never a Kairos
# dependency): ensure_venv VENV SPEC PYTHON creates VENV with PYTHON if it is missing and installs
# SPEC (a list of requirements) into it; a stamp skips the install when SPEC has not changed.
ensure_venv() {
  local venv=$1 spec=$2 python=$3
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  local stamp="$venv/.kairos-installed"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$spec" ]; then
    echo "kairos: installing $spec into $venv" >&2
    # shellcheck disable=SC2086 # the spec is a list of requirements
    "$venv/bin/python" -m pip install -q $spec
    echo "$spec" > "$stamp"
  fi
}
