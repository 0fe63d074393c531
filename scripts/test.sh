#!/usr/bin/env bash
# Installs everything the test suite needs into a virtual environment and runs the whole suite.
# Usage: scripts/test.sh [pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${GPUSCHED_VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" || exit 1
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null || exit 1
"$VENV/bin/python" -m pip install -q -e ".[test]" || exit 1

for step in scripts/test.d/*.sh; do
    [ -e "$step" ] || continue
    VENV="$VENV" bash "$step" || { echo "test setup step $step failed" >&2; exit 1; }
done

"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"
