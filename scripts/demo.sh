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
# The plot extra: `jupyter gpusched simulate --plot` draws its chart in the demo too; notebook:
# Notebook 7 (/tree) beside JupyterLab.
"$VENV/bin/python" -m pip install -q -e ".[plot]" jupyterlab "notebook>=7"

# A kernelspec whose kernels get their GPU from the scheduler at their first cell.
"$VENV/bin/jupyter" gpusched kernelspec install --name python3-gpu --gpus 1 --bind lazy \
    --display-name "Python 3 (1 GPU)" --sys-prefix >/dev/null

args=()
if "$VENV/bin/python" -c "import pynvml; pynvml.nvmlInit()" >/dev/null 2>&1; then
    echo "NVIDIA GPUs found: scheduling them through NVML."
    args+=(--GPUSchedApp.backend=nvml)
else
    echo "No NVIDIA GPU here: starting on 4 simulated GPUs."
    # A simulated checkpoint holds no host RAM, so the budget is what the four simulated 80 GiB
    # GPUs could hold; half of this machine's RAM (the default, right for real GPUs) would turn
    # every reclaim after the first checkpoint into a restart here.
    args+=(--GPUSchedApp.backend=simulated --GPUSchedApp.simulated_devices=4
           --GPUSchedApp.checkpoint_host_memory=320GiB)
fi
if [ "$(id -u)" = "0" ]; then
    args+=(--allow-root)
fi
exec "$VENV/bin/jupyter" lab "${args[@]}" "$@"
