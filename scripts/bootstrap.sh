# Sourced by run.sh and test.sh: create .venv and install the project into it, once per change of
# pyproject.toml. Needs only Python 3.11+ (and Java 17 for the Spark audit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
  touch "$stamp"
fi
