#!/usr/bin/env bash
# One check of this package on a machine with an NVIDIA GPU, in at most 8 minutes:
#   1. every test marked `gpu` (pytest -m gpu: the NVML contract, PyTorch checkpointed and restored
#      by a real server, a real MPS control daemon), each test a row;
#   2. checkpoint and restore of a process holding 1, 4 and 16 GiB, with the pinned copy bandwidth
#      measured in the same run (benchmarks/gpu_checkpoint.py).
# Prints one table and writes one JSON document to the first argument, else $OUT/gpu-check.json
# when OUT is set, else ./gpu-check.json. Every row says passed, failed, skipped or not run, and why.
#
# Installs what it needs into the virtual environment scripts/test.sh uses ($GPUSCHED_VENV, default
# .venv): this package with its test extras, PyTorch built for the driver's CUDA, cuda-python.
# Changes no GPU setting. Where there is no GPU (no nvidia-smi and no NVML, NVML cannot start, or
# no device), it says so in one line, writes a JSON document saying so, installs and runs nothing,
# and exits 0. Otherwise it exits 1 when a row failed, else 0.
#
# Usage: scripts/gpu-check.sh [OUT.json]
# Environment: GPU_CHECK_BUDGET (seconds for the whole run, default 450),
#              GPU_CHECK_SIZES (GiB, default 1,4,16), GPUSCHED_VENV, PYTHON.
set -uo pipefail

START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-450}
SIZES=${GPU_CHECK_SIZES:-1,4,16}

OUT_JSON=${1:-}
if [ -z "$OUT_JSON" ]; then
    if [ -n "${OUT:-}" ]; then OUT_JSON="$OUT/gpu-check.json"; else OUT_JSON="./gpu-check.json"; fi
fi
case "$OUT_JSON" in /*) ;; *) OUT_JSON="$PWD/$OUT_JSON" ;; esac
cd "$(dirname "$0")/.." || exit 1

json_string() {
    local s=$1
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=$(printf '%s' "$s" | tr -d '\000-\037')
    printf '"%s"' "$s"
}

one_line() { printf '%s' "$1" | tr '\t\r\n' '   ' | cut -c1-300; }

# -- is there a GPU? -------------------------------------------------------------------------------
NO_GPU=""
GPU_LIST=""
if command -v nvidia-smi >/dev/null 2>&1; then
    if ! smi=$(timeout 30 nvidia-smi -L 2>&1); then
        NO_GPU="nvidia-smi could not talk to the NVIDIA driver: $(one_line "$(printf '%s\n' "$smi" | head -n 1)")"
    elif ! grep -q '^GPU [0-9]' <<<"$smi"; then
        NO_GPU="nvidia-smi lists no GPU"
    else
        GPU_LIST=$smi
    fi
else
    # No nvidia-smi: ask NVML itself (a container may have the library without the tool).
    probe=nopython
    if command -v python3 >/dev/null 2>&1; then
        probe=$(timeout 30 python3 - 2>/dev/null <<'PY'
import ctypes
try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
except OSError:
    print("nolib")
    raise SystemExit
if nvml.nvmlInit_v2() != 0:
    print("noinit")
    raise SystemExit
count = ctypes.c_uint(0)
print(count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else "nocount")
nvml.nvmlShutdown()
PY
        )
    fi
    case "$probe" in
        [1-9]*) GPU_LIST="$probe GPU(s) seen through NVML (nvidia-smi is not on PATH)" ;;
        noinit) NO_GPU="nvidia-smi is not on PATH and NVML could not initialize (no NVIDIA driver loaded)" ;;
        0 | nocount) NO_GPU="nvidia-smi is not on PATH and NVML sees no GPU" ;;
        nolib) NO_GPU="nvidia-smi is not on PATH and the NVML library (libnvidia-ml.so.1) is not installed" ;;
        nopython) NO_GPU="nvidia-smi is not on PATH (and there is no python3 to ask NVML)" ;;
        *) NO_GPU="nvidia-smi is not on PATH and NVML did not answer" ;;
    esac
fi

if [ -n "$NO_GPU" ]; then
    echo "gpu-check: no NVIDIA GPU on this machine ($NO_GPU); nothing was installed or run."
    mkdir -p "$(dirname "$OUT_JSON")" 2>/dev/null
    printf '{"gpu": false, "reason": %s, "rows": [], "summary": {"passed": 0, "failed": 0, "skipped": 0, "not run": 0}}\n' \
        "$(json_string "$NO_GPU")" >"$OUT_JSON" || echo "gpu-check: could not write $OUT_JSON" >&2
    exit 0
fi

# -- a GPU is there --------------------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") || exit 1
STEPS="$WORK/steps.tsv"
TESTS="$WORK/tests.jsonl"
MEASURE="$WORK/measure.json"
: >"$STEPS"
mkdir -p "$(dirname "$OUT_JSON")" || exit 1

left() { echo $((BUDGET - ($(date +%s) - START))); }
# box WANT RESERVE: WANT seconds, or what is left once RESERVE seconds are kept for later steps.
box() {
    local want=$1 reserve=$2 rest
    rest=$(($(left) - reserve))
    [ "$rest" -lt "$want" ] && want=$rest
    echo "$want"
}
step() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(one_line "$4")" >>"$STEPS"; }
since() { echo $(($(date +%s) - $1)); }

DRIVER=$(timeout 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')
DRIVER_CUDA=$(timeout 20 nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9][0-9.]*' | head -n 1 | grep -o '[0-9][0-9.]*$')
GPUS=$(timeout 20 nvidia-smi --query-gpu=index,name,memory.total,mig.mode.current --format=csv,noheader 2>/dev/null | paste -sd ';' -)
echo "gpu-check: $(printf '%s' "$GPU_LIST" | grep -c '^GPU [0-9]') GPU(s), driver ${DRIVER:-unknown} (CUDA ${DRIVER_CUDA:-unknown}); budget ${BUDGET} s; work files in $WORK"
step "GPU present" passed 0 "${GPUS:-$GPU_LIST}; driver ${DRIVER:-unknown}, CUDA ${DRIVER_CUDA:-unknown}"

# -- setup: the virtual environment, this package, PyTorch with CUDA, cuda-python ------------------
VENV=${GPUSCHED_VENV:-.venv}
PY="$VENV/bin/python"
SYSTEM_PY=${PYTHON:-python3}
SETUP_OK=1
SETUP_END=$((START + BUDGET - 240))   # at least four minutes stay for the tests and the measurement
setup_box() { local rest=$((SETUP_END - $(date +%s))); [ "$rest" -gt 5 ] && echo "$rest" || echo 5; }
pip_quiet() { timeout -k 5 "$(setup_box)" "$PY" -m pip install -q --disable-pip-version-check --no-input "$@" >>"$WORK/setup.log" 2>&1; }

t=$(date +%s)
if [ ! -x "$PY" ]; then
    if "$SYSTEM_PY" -m venv "$VENV" >>"$WORK/setup.log" 2>&1; then
        step "setup: virtual environment $VENV" passed "$(since "$t")" "created"
    else
        step "setup: virtual environment $VENV" failed "$(since "$t")" "$SYSTEM_PY -m venv failed: $(tail -n 1 "$WORK/setup.log")"
        SETUP_OK=0
    fi
else
    step "setup: virtual environment $VENV" passed 0 "already there"
fi

if [ "$SETUP_OK" = 1 ]; then
    t=$(date +%s)
    if "$PY" - >/dev/null 2>&1 <<'PY'
import importlib.util, os, sys
import jupyter_gpusched
inside = os.path.realpath(jupyter_gpusched.__file__).startswith(os.path.realpath(os.getcwd()) + os.sep)
needed = ("pytest", "pytest_jupyter", "pytest_timeout", "pynvml", "ipykernel")
sys.exit(0 if inside and all(importlib.util.find_spec(name) for name in needed) else 1)
PY
    then
        step "setup: jupyter-gpusched and its test extras" passed 0 "already installed from this checkout"
    else
        note="pip install -e .[test]"
        if ! command -v node >/dev/null 2>&1; then
            # The GPU checks need only the Python side; the lab extension's build needs Node.js.
            export SKIP_JUPYTER_BUILDER=1
            note="$note, without the JupyterLab extension (Node.js is not installed)"
        fi
        if pip_quiet -e ".[test]"; then
            step "setup: jupyter-gpusched and its test extras" passed "$(since "$t")" "$note"
        else
            step "setup: jupyter-gpusched and its test extras" failed "$(since "$t")" "$note failed or ran out of time: $(tail -n 1 "$WORK/setup.log")"
            SETUP_OK=0
        fi
    fi
fi

# PyTorch's CUDA must be one the driver runs: the PyPI build follows the newest CUDA; for an older
# driver, the PyTorch index's build for its CUDA release.
torch_index() {
    local major=${DRIVER_CUDA%%.*} minor=${DRIVER_CUDA#*.}
    minor=${minor%%.*}
    if [ -z "$DRIVER_CUDA" ] || [ "$major" -ge 13 ] 2>/dev/null; then
        echo ""
    elif [ "$major" -eq 12 ] && [ "$minor" -ge 8 ]; then
        echo "https://download.pytorch.org/whl/cu128"
    else
        echo "https://download.pytorch.org/whl/cu126"
    fi
}
torch_ok() { "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

if [ "$SETUP_OK" = 1 ]; then
    t=$(date +%s)
    if torch_ok; then
        step "setup: PyTorch with CUDA" passed 0 "$("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)"
    else
        index=$(torch_index)
        args=(torch)
        [ -n "$index" ] && args+=(--index-url "$index")
        if "$PY" -c "import torch" >/dev/null 2>&1; then
            # Installed, but without CUDA or for a CUDA the driver does not run: replace it.
            pip_quiet --force-reinstall --no-deps "${args[@]}" && pip_quiet "${args[@]}"
        else
            pip_quiet "${args[@]}"
        fi
        if torch_ok; then
            step "setup: PyTorch with CUDA" passed "$(since "$t")" "installed $("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null) from ${index:-PyPI}"
        else
            why=$("$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'sees no usable GPU')" 2>&1 | tail -n 1)
            step "setup: PyTorch with CUDA" failed "$(since "$t")" "from ${index:-PyPI}: $why $(tail -n 1 "$WORK/setup.log")"
            # The NVML and MPS tests need no PyTorch: go on; the rest say they were skipped.
        fi
    fi

    t=$(date +%s)
    major=${DRIVER_CUDA%%.*}
    if [ -n "$major" ] && [ "$major" -lt 13 ] 2>/dev/null; then
        spec="cuda-python>=12.8,<13"
    else
        spec="cuda-python>=13.0.2"
    fi
    have=$("$PY" -c "from importlib.metadata import version; print(version('cuda-bindings'))" 2>/dev/null)
    fits=1
    [ -z "$have" ] && fits=0
    [ -n "$have" ] && [ -n "$major" ] && [ "${have%%.*}" != "$major" ] && fits=0
    if [ "$fits" = 1 ] && "$PY" -c "from cuda.bindings import driver; driver.cuCheckpointProcessCheckpoint" >/dev/null 2>&1; then
        step "setup: cuda-python" passed 0 "cuda-bindings $have"
    elif pip_quiet "$spec"; then
        step "setup: cuda-python" passed "$(since "$t")" "installed $spec (cuda-bindings $("$PY" -c "from importlib.metadata import version; print(version('cuda-bindings'))" 2>/dev/null))"
    else
        step "setup: cuda-python" failed "$(since "$t")" "pip install $spec: $(tail -n 1 "$WORK/setup.log")"
    fi
fi

# -- the tests marked gpu --------------------------------------------------------------------------
STOPPED=""
mapfile -t GPU_FILES < <(grep -lE 'mark\.gpu' tests/test_*.py 2>/dev/null | sort)
if [ "$SETUP_OK" != 1 ]; then
    step "pytest -m gpu" "not run" "" "the setup failed (see the rows above)"
elif [ "${#GPU_FILES[@]}" -eq 0 ]; then
    step "pytest -m gpu" "not run" "" "no test file has a gpu mark"
else
    TEST_BOX=$(box 210 150)
    if [ "$TEST_BOX" -lt 30 ]; then
        step "pytest -m gpu" "not run" "" "time short: $(left) s left of ${BUDGET} s after the setup"
    else
        echo "gpu-check: pytest -m gpu ${GPU_FILES[*]} (at most ${TEST_BOX} s)"
        t=$(date +%s)
        GPU_CHECK_RESULTS="$TESTS" PYTHONPATH="$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" \
            timeout -k 10 "$TEST_BOX" "$PY" -m pytest -m gpu -p gpu_checkpoint -p no:cacheprovider \
            -q -rA --timeout 180 "${GPU_FILES[@]}" >"$WORK/pytest.log" 2>&1
        rc=$?
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            STOPPED="pytest was stopped at its time box of ${TEST_BOX} s"
            step "pytest -m gpu" failed "$(since "$t")" "$STOPPED"
        elif [ "$rc" -eq 0 ]; then
            step "pytest -m gpu" passed "$(since "$t")" "each test is a row below; log in $WORK/pytest.log"
        elif [ "$rc" -eq 1 ]; then
            step "pytest -m gpu" failed "$(since "$t")" "some tests failed (rows below); log in $WORK/pytest.log"
        elif [ "$rc" -eq 5 ]; then
            step "pytest -m gpu" "not run" "$(since "$t")" "pytest collected no test marked gpu"
        else
            step "pytest -m gpu" failed "$(since "$t")" "pytest exited $rc: $(tail -n 1 "$WORK/pytest.log")"
        fi
    fi
fi

# -- checkpoint and restore, against the copy bandwidth --------------------------------------------
MEASURE_MISSING=""
if [ "$SETUP_OK" != 1 ]; then
    MEASURE_MISSING="the setup failed (see the rows above)"
elif ! torch_ok; then
    MEASURE_MISSING="PyTorch with CUDA is not usable here (see the setup rows)"
else
    MEASURE_BOX=$(box 300 20)
    if [ "$MEASURE_BOX" -lt 45 ]; then
        MEASURE_MISSING="time short: $(left) s left of ${BUDGET} s"
    else
        echo "gpu-check: checkpoint and restore of ${SIZES} GiB (at most ${MEASURE_BOX} s)"
        timeout -k 10 "$MEASURE_BOX" "$PY" benchmarks/gpu_checkpoint.py measure --out "$MEASURE" \
            --sizes "$SIZES" --seconds $((MEASURE_BOX - 15)) >"$WORK/measure.log" 2>&1
        rc=$?
        # A process the measurement started and could not end (it was killed at its time box).
        pid=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1])).get('child_pid') or '')" "$MEASURE" 2>/dev/null)
        [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
        if [ "$rc" -ne 0 ]; then
            step "checkpoint measurement" failed "" "exited $rc$([ "$rc" -eq 124 ] && echo ' at its time box'): $(tail -n 1 "$WORK/measure.log")"
        fi
    fi
fi

# -- one table, one JSON document ------------------------------------------------------------------
REPORT_PY=$PY
[ -x "$REPORT_PY" ] || REPORT_PY=$SYSTEM_PY
"$REPORT_PY" - "$WORK/meta.json" "$DRIVER" "$DRIVER_CUDA" "$GPUS" "$START" "$BUDGET" <<'PY' 2>/dev/null
import json, platform, sys, time
from importlib.metadata import version

def have(name):
    try:
        return version(name)
    except Exception:
        return None

out, driver, cuda, gpus, start, budget = sys.argv[1:]
json.dump({"driver": driver or None, "driver_cuda": cuda or None,
           "gpus": [g.strip() for g in gpus.split(";") if g.strip()],
           "host": platform.node(), "python": platform.python_version(),
           "torch": have("torch"), "cuda_bindings": have("cuda-bindings"), "nvidia_ml_py": have("nvidia-ml-py"),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(start))),
           "seconds": round(time.time() - int(start)), "budget_s": int(budget)}, open(out, "w"))
PY
"$REPORT_PY" benchmarks/gpu_checkpoint.py report --out "$OUT_JSON" --steps "$STEPS" --tests "$TESTS" \
    --tests-stopped "$STOPPED" --measure "$MEASURE" --measure-missing "$MEASURE_MISSING" \
    --sizes "$SIZES" --meta "$WORK/meta.json"
rc=$?
echo "gpu-check: $(($(date +%s) - START)) s; JSON in $OUT_JSON; logs in $WORK"
exit "$rc"
