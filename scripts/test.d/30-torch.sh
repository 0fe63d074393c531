#!/usr/bin/env bash
# The tests of the PyTorch import hook (tests/test_shared_limits.py: a shared lease's kernel gets
# its memory fraction queued for CUDA's initialization when it imports torch, and nothing
# initializes CUDA) import the real torch. The PyPI build runs on a machine without a GPU (CUDA
# is never initialized there). Installs it when missing; does nothing when it is there.
set -uo pipefail
VENV=${VENV:-.venv}

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q torch >/dev/null 2>&1 || {
        echo "could not install torch into $VENV" >&2
        exit 1
    }
fi
exit 0
