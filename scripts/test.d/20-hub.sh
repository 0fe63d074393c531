#!/usr/bin/env bash
# Hub-mode tests (tests/test_hub.py) run a real JupyterHub: it must be in the virtual environment,
# and configurable-http-proxy on PATH. Installs what is missing; does nothing when both are there.
set -uo pipefail
VENV=${VENV:-.venv}

if ! "$VENV/bin/python" -c "import jupyterhub" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q jupyterhub >/dev/null 2>&1 || {
        echo "could not install jupyterhub into $VENV" >&2
        exit 1
    }
fi

if ! command -v configurable-http-proxy >/dev/null 2>&1 && [ ! -x "$VENV/bin/configurable-http-proxy" ]; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "configurable-http-proxy is missing and npm is not installed to get it (install Node.js and npm)" >&2
        exit 1
    fi
    # Globally where allowed (as the hub's docs do), else into the virtual environment's bin/.
    npm install -g --silent --no-fund --no-audit configurable-http-proxy >/dev/null 2>&1 \
        || npm install -g --silent --no-fund --no-audit --prefix "$VENV" configurable-http-proxy >/dev/null 2>&1 \
        || {
            echo "could not install configurable-http-proxy with npm" >&2
            exit 1
        }
fi
exit 0
