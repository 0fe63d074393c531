#!/usr/bin/env bash
# Starts JupyterLab with the GPU scheduler. Where no NVIDIA GPU is found it runs on 4 simulated
# GPUs, so that everything can be tried on any machine.
# Usage: scripts/demo.sh [jupyter lab arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${GPUSCHED_VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
# The plot extra: `jupyter gpusched simulate --plot` draws its chart in the demo too.
"$VENV/bin/python" -m pip install -q -e ".[plot]" jupyterlab

# A kernelspec whose kernels get their GPU from the scheduler at their first cell.
"$VENV/bin/jupyter" gpusched kernelspec install --name python3-gpu --gpus 1 --bind lazy \
    --display-name "Python 3 (1 GPU)" --sys-prefix >/dev/null

args=()
if "$VENV/bin/python" -c "import pynvml; pynvml.nvmlInit()" >/dev/null 2>&1; then
    echo "NVIDIA GPUs found: scheduling them through NVML."
    args+=(--GPUSchedApp.backend=nvml)
else
    echo "No NVIDIA GPU here: starting on 4 simulated GPUs."
    args+=(--GPUSchedApp.backend=simulated --GPUSchedApp.simulated_devices=4)
fi
if [ "$(id -u)" = "0" ]; then
    args+=(--allow-root)
fi
exec "$VENV/bin/jupyter" lab "${args[@]}" "$@"
