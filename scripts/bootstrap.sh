# Sourced by run.sh and test.sh: create .venv and install the project into it, once per change of
# pyproject.toml. Needs only Python 3.11+ (and Java 17 for the Spark audit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-}"
install() {  # pip's output goes to a log, shown only when the install fails
  if ! "$@" > .venv/install.log 2>&1; then
    tail -n 40 .venv/install.log >&2
    echo "bootstrap: installing into .venv failed; full log in .venv/install.log" >&2
    exit 1
  fi
}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  install .venv/bin/python -m pip install --upgrade pip
fi
stamp=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing the project into .venv${EXTRAS:+ with [$EXTRAS]}" >&2
  install .venv/bin/python -m pip install -e ".${EXTRAS:+[$EXTRAS]}"
  touch "$stamp"
fi
