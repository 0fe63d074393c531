#!/usr/bin/env bash
# Browser tests drive the distribution's Chromium (/usr/bin/chromium) through Playwright's Python
# package; Playwright's own browser download is never used. Installs what is missing, quietly.
set -uo pipefail

VENV=${VENV:-.venv}

if [ ! -x /usr/bin/chromium ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
        echo "installing Chromium for the browser tests" >&2
        if ! log=$(export DEBIAN_FRONTEND=noninteractive
                   apt-get update -qq 2>&1 && apt-get install -y -qq chromium 2>&1); then
            printf '%s\n' "$log" >&2
            echo "could not install Chromium with apt-get; the browser tests will be skipped" >&2
        fi
    else
        echo "Chromium is missing and only root can install it (apt-get install chromium);" \
             "the browser tests will be skipped" >&2
    fi
fi

if ! "$VENV/bin/python" -c "import playwright" >/dev/null 2>&1; then
    if ! log=$("$VENV/bin/python" -m pip install -q playwright 2>&1); then
        printf '%s\n' "$log" >&2
        exit 1
    fi
fi
exit 0
