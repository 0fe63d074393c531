#!/usr/bin/env bash
# Installs everything the test suite needs into a virtual environment and runs the whole suite.
# Usage: scripts/test.sh [pytest arguments]
#        scripts/test.sh -m unit    the one-minute tier: skips the browser, hub and torch setup steps
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${GPUSCHED_VENV:-.venv}
PYTHON=${PYTHON:-python3}

# The marker expression asked for (-m EXPR or -mEXPR), if any.
MARKERS=""
prev=""
for arg in "$@"; do
    if [ "$prev" = "-m" ]; then
        MARKERS=$arg
    elif [ "${arg#-m}" != "$arg" ] && [ "$arg" != "-m" ] && [ "${arg#--}" = "$arg" ]; then
        MARKERS=${arg#-m}
    fi
    prev=$arg
done
# Only the unit tier: none of its tests drives a browser, starts a hub or imports torch.
UNIT_ONLY=0
case "$MARKERS" in
    unit | "unit and "*) UNIT_ONLY=1 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" || exit 1
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null || exit 1
"$VENV/bin/python" -m pip install -q -e ".[test]" || exit 1

for step in scripts/test.d/*.sh; do
    [ -e "$step" ] || continue
    if [ "$UNIT_ONLY" = 1 ]; then
        case "$(basename "$step")" in
            *chromium* | *hub* | *torch*) continue ;;
        esac
    fi
    VENV="$VENV" bash "$step" || { echo "test setup step $step failed" >&2; exit 1; }
done

"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"
