"""Every benchmark, in a few-second run: it must measure something and exit 0, and a run that
measures nothing must exit non-zero and say so. A benchmark that stops measuring (as
``hub_load.py`` once did, when the broker refused its stand-in servers and every claim answered
404) fails here instead of printing zeros."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

pytestmark = pytest.mark.timeout(180)


def bench(script: str, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )


def measured(script: str, *args: str) -> dict:
    """The JSON a benchmark printed, once it exited 0."""
    done = bench(script, *args, "--json")
    assert done.returncode == 0, f"{script} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout[done.stdout.index("{"):])


def test_core_tick_times_passes_that_decide():
    done = bench("core_tick.py", "--kernels", "50,100", "--devices", "8", "--budget", "0.05")
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("50", "8"), ("100", "8")]
    assert all(float(r[2]) > 0 and int(r[4]) >= 1 for r in rows)
    assert any(int(r[5]) > 0 for r in rows), "some pass made a decision"


def test_ledger_grants_grants_from_one_process_and_from_several():
    report = measured("ledger_grants.py", "--seconds", "0.5", "--processes", "2")
    assert report["one_process"]["grants"] > 0 and report["shared"]["grants"] > 0
    assert report["one_process"]["problems"] == [] and report["shared"]["problems"] == []


def test_ledger_soak_samples_the_ledger_with_and_without_retention():
    report = measured(
        "ledger_soak.py", "--cycles", "300", "--history-days", "0.05", "--prune-every", "20", "--window", "50"
    )
    runs = {run["retention"]: run for run in report["runs"]}
    assert set(runs) == {True, False}
    assert all(run["points"] and run["problems"] == [] for run in runs.values())
    assert runs[True]["pruned"] > 0 and runs[False]["pruned"] == 0


def test_trace_replay_replays_every_policy_and_finds_capacities():
    report = measured("trace_replay.py", "--gpus", "64")
    policies = report["hosts"]["64"]
    assert {"static", "hybrid", "oracle"} <= set(policies)
    assert all(p["passes"] > 0 for p in policies.values())
    assert report["capacity"]["oracle"]["gpus"] is not None


def test_trace_replay_measures_cost_against_sessions():
    report = measured("trace_replay.py", "--sessions", "100,200", "--policies", "hybrid,oracle", "--host", "64")
    assert [row["sessions"] for row in report["rows"]] == [100, 200]
    assert all(row["passes"]["hybrid"] > 0 and row["oracle_held_equals_busy"] for row in report["rows"])


def test_checkpoint_sensitivity_gives_a_row_per_bandwidth_and_budget():
    report = measured("checkpoint_sensitivity.py", "--bandwidths", "10", "--budgets", "64,unlimited")
    assert [row["checkpoint_host_memory_gb"] for row in report["rows"]] == [64, None]
    assert all(row["gpu_hours_held"] > 0 for row in report["rows"])


def test_rest_grants_grants_through_a_real_server_against_its_baseline():
    report = measured(
        "rest_grants.py", "--clients", "2", "--gpus", "1", "--seconds", "1", "--baseline-seconds", "0.5",
        "--rounds", "1", "--warmup", "0.2",
    )
    assert report["grants"]["granted"] > 0 and report["baseline"]["requests"] > 0
    assert report["ratios"]["claim_p50_vs_baseline"] > 0
    assert report["ledger"]["problems"] == []


def test_kernel_start_starts_each_kind_of_kernel():
    report = measured("kernel_start.py", "--rounds", "1", "--warmup", "0", "--gpus", "2")
    assert {label: k["starts"] for label, k in report["kinds"].items()} == {
        "local-provisioner": 1, "gpusched lazy": 1, "gpusched launch": 1,
    }


@pytest.mark.hub
def test_hub_load_grants_through_a_real_hub_to_servers_the_broker_accepts():
    report = measured(
        "hub_load.py", "--users", "2", "--gpus", "1", "--seconds", "2", "--baseline-seconds", "1", "--rounds", "1"
    )
    assert report["servers_unconnected"] == []
    assert report["grants"] > 0 and report["statuses"] > 0 and report["errors"] == 0, report["error_examples"]
    assert report["claim_ms"]["p50"] > 0 and report["status_ms"]["p50"] > 0
    assert report["double_grants"] == [] and report["ledger_problems"] == [] and report["measured_nothing"] == []


def test_gpu_checkpoint_without_a_gpu_measures_nothing_and_says_why(tmp_path):
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass  # no GPU here: what this test is for
    else:
        pynvml.nvmlShutdown()
        pytest.skip("a GPU is here: scripts/gpu-check.sh runs the real measurement")
    out = tmp_path / "measure.json"
    done = bench("gpu_checkpoint.py", "measure", "--out", str(out), "--sizes", "1", "--seconds", "10")
    assert done.returncode == 1 and "measured nothing: NVML" in done.stderr
    data = json.loads(out.read_text())
    assert data["copy"]["status"] == "not run" and [s["status"] for s in data["sizes"]] == ["not run"]


@pytest.mark.parametrize(
    "script, args",
    [
        ("core_tick.py", ["--kernels", "0", "--devices", "8", "--budget", "0.01"]),
        ("ledger_grants.py", ["--seconds", "0", "--processes", "1"]),
        ("ledger_soak.py", ["--cycles", "0"]),
        ("trace_replay.py", ["--gpus", ","]),
        ("trace_replay.py", ["--sessions", "100", "--policies", ","]),
        ("checkpoint_sensitivity.py", ["--bandwidths", ","]),
    ],
)
def test_a_run_that_measures_nothing_exits_non_zero(script, args):
    done = bench(script, *args)
    assert done.returncode == 1
    assert "measured nothing" in done.stderr.splitlines()[-1]
