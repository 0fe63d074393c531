"""scripts/gpu-check.sh where there is no GPU, and the table and JSON of benchmarks/gpu_checkpoint.py.

The script's GPU part needs an NVIDIA GPU and is not run here. Where the machine has none (or the
script is shown an ``nvidia-smi`` that cannot reach a driver) it must say so in one line, write a
JSON document saying so, install and run nothing, and exit 0 at once. The formatting functions are
pure and are checked with made-up timings.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
BENCH = ROOT / "benchmarks" / "gpu_checkpoint.py"
GiB = 1 << 30


def _load_bench():
    spec = importlib.util.spec_from_file_location("gpu_checkpoint_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _has_nvml() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


# -- the script, no GPU ---------------------------------------------------------------------------


def _tool_dir(tmp_path: Path, nvidia_smi: str | None) -> Path:
    """A PATH of the plain tools the script uses, a python3 and pip that leave a mark if run, and
    (if given) an ``nvidia-smi`` with that body."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "timeout", "tr", "cut", "grep", "head", "tail", "mkdir", "dirname", "date",
                 "cat", "mktemp", "paste", "env"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    marker = tmp_path / "ran"
    for name in ("python3", "python", "pip", "pip3"):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {marker}\nexit 1\n")
        shim.chmod(0o755)
    if nvidia_smi is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + nvidia_smi)
        smi.chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float, Path]:
    out = tmp_path / "out" / "out.json"
    work_tmp = tmp_path / "tmp"
    work_tmp.mkdir()
    venv = tmp_path / "venv"
    env = {**env, "GPUSCHED_VENV": str(venv), "TMPDIR": str(work_tmp), "OUT": str(tmp_path / "elsewhere")}
    began = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    took = time.monotonic() - began
    assert not venv.exists(), "no virtual environment is made where there is no GPU"
    assert list(work_tmp.iterdir()) == [], "no work files either"
    assert not (tmp_path / "elsewhere").exists(), "the first argument wins over $OUT"
    return done, took, out


def _assert_no_gpu_answer(done: subprocess.CompletedProcess, took: float, out: Path, why: str) -> None:
    assert done.returncode == 0, done.stderr
    assert took < 30
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    assert lines[0].startswith("gpu-check: no NVIDIA GPU on this machine (")
    assert lines[0].endswith("nothing was installed or run.")
    assert why in lines[0]
    assert done.stderr == ""
    document = json.loads(out.read_text())
    assert document["gpu"] is False and why in document["reason"]
    assert document["rows"] == [] and sum(document["summary"].values()) == 0


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or _has_nvml(), reason="this machine has an NVIDIA driver"
)
def test_on_this_machine_without_a_gpu_the_script_says_so_and_exits_0(tmp_path):
    done, took, out = _run(tmp_path, dict(os.environ))
    _assert_no_gpu_answer(done, took, out, "nvidia-smi is not on PATH")


def test_an_nvidia_smi_that_cannot_reach_a_driver_means_no_gpu(tmp_path):
    smi = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n'
    bin_dir = _tool_dir(tmp_path, smi)
    done, took, out = _run(tmp_path, {"PATH": str(bin_dir), "HOME": str(tmp_path)})
    _assert_no_gpu_answer(done, took, out, "nvidia-smi could not talk to the NVIDIA driver: NVIDIA-SMI has failed")
    assert not (tmp_path / "ran").exists(), "neither Python nor pip ran"


def test_an_nvidia_smi_that_lists_no_gpu_means_no_gpu(tmp_path):
    bin_dir = _tool_dir(tmp_path, 'echo "No devices were found"\nexit 0\n')
    done, took, out = _run(tmp_path, {"PATH": str(bin_dir), "HOME": str(tmp_path)})
    _assert_no_gpu_answer(done, took, out, "nvidia-smi lists no GPU")
    assert not (tmp_path / "ran").exists()


def test_without_an_argument_the_json_goes_to_out(tmp_path):
    bin_dir = _tool_dir(tmp_path, 'exit 9\n')
    out_dir = tmp_path / "collected"
    done = subprocess.run(["bash", str(SCRIPT)], env={"PATH": str(bin_dir), "OUT": str(out_dir)},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0
    assert json.loads((out_dir / "gpu-check.json").read_text())["gpu"] is False
    done = subprocess.run(["bash", str(SCRIPT)], env={"PATH": str(bin_dir)}, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0
    assert json.loads((tmp_path / "gpu-check.json").read_text())["gpu"] is False


# -- figures, rows, the table, the document -------------------------------------------------------

MEASURE = {
    "device": {"index": 0, "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GiB},
    "checkpointer": {"kind": "DriverCheckpointer", "available": True, "reason": "CUDA driver checkpoint API", "remap": True},
    "copy": {"status": "passed", "bytes": GiB, "repeats": 5, "h2d_s": 0.05, "d2h_s": 0.04,
             "h2d_gbps": GiB / 0.05 / 1e9, "d2h_gbps": GiB / 0.04 / 1e9},
    "sizes": [
        {"gib": 1, "status": "passed", "bytes": int(1.5 * GiB), "bytes_source": "NVML, the process",
         "checkpoint_s": 0.8, "restore_s": 0.4, "pattern": "intact", "freed": True},
        {"gib": 4, "status": "failed", "bytes": int(4.5 * GiB), "bytes_source": "NVML, the process",
         "checkpoint_s": 2.0, "restore_s": None, "reason": "restore: cuCheckpointProcessRestore failed: CUDA_ERROR_OUT_OF_MEMORY"},
        {"gib": 16, "status": "skipped", "reason": "the GPU has 10.0 GiB free, 17.5 GiB needed"},
    ],
}


def test_gbps_and_ratio_are_none_where_a_figure_is_missing():
    assert bench.gbps(2e9, 1.0) == 2.0
    assert bench.gbps(None, 1.0) is None and bench.gbps(1e9, None) is None and bench.gbps(1e9, 0) is None
    assert bench.ratio(1.0, 4.0) == 0.25
    assert bench.ratio(None, 4.0) is None and bench.ratio(1.0, None) is None and bench.ratio(1.0, 0.0) is None


def test_measurement_rows_give_each_size_gbps_and_its_ratio_to_the_copy_bandwidth():
    rows = bench.measurement_rows(MEASURE)
    by_check = {row["check"]: row for row in rows}
    h2d = GiB / 0.05 / 1e9  # 21.47 GB/s
    assert by_check["copy host to device (pinned, torch)"]["copy_gbps"] == pytest.approx(h2d)
    assert by_check["copy device to host (pinned, torch)"]["copy_gbps"] == pytest.approx(GiB / 0.04 / 1e9)
    one = by_check["checkpoint and restore 1 GiB"]
    assert one["status"] == "passed"
    assert one["checkpoint_gbps"] == pytest.approx(1.5 * GiB / 0.8 / 1e9)
    assert one["restore_gbps"] == pytest.approx(1.5 * GiB / 0.4 / 1e9)
    assert one["copy_gbps"] == pytest.approx(h2d)
    assert one["checkpoint_ratio"] == pytest.approx(1.5 * GiB / 0.8 / 1e9 / h2d)
    assert one["restore_ratio"] == pytest.approx(1.5 * GiB / 0.4 / 1e9 / h2d)
    assert one["checkpoint_vs_d2h"] == pytest.approx(1.5 * GiB / 0.8 / 1e9 / (GiB / 0.04 / 1e9))
    assert "1.50 GiB moved (NVML, the process)" in one["note"] and "pattern intact" in one["note"]
    four = by_check["checkpoint and restore 4 GiB"]
    assert four["status"] == "failed" and four["restore_gbps"] is None and four["restore_ratio"] is None
    assert "CUDA_ERROR_OUT_OF_MEMORY" in four["note"]
    sixteen = by_check["checkpoint and restore 16 GiB"]
    assert sixteen["status"] == "skipped" and "17.5 GiB needed" in sixteen["note"]
    assert bench.measurement_rows(None) == []


def test_the_table_has_one_line_per_row_and_the_figures_rounded():
    rows = bench.measurement_rows(MEASURE)
    table = bench.format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0] == (
        "| check | status | s | checkpoint s | checkpoint GB/s | restore s | restore GB/s | copy H2D GB/s"
        " | checkpoint / copy | restore / copy | note |"
    )
    one = next(line for line in lines if "checkpoint and restore 1 GiB" in line)
    cells = [cell.strip() for cell in one.strip("|").split("|")]
    assert cells[:10] == ["checkpoint and restore 1 GiB", "passed", "", "0.80", "2.0", "0.40", "4.0", "21.5", "0.09", "0.19"]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_the_table_leaves_out_empty_columns_and_escapes_pipes():
    table = bench.format_table([{"check": "a | b", "status": "passed", "seconds": 1.0, "note": "x\ny"}])
    assert table.splitlines() == ["| check | status | s | note |", "| --- | --- | --- | --- |", "| a / b | passed | 1.00 | x y |"]


def test_test_rows_merge_phases_and_say_what_never_ran():
    records = [
        {"collected": ["t.py::ok", "t.py::skip", "t.py::bad", "t.py::broken", "t.py::late"]},
        {"nodeid": "t.py::ok", "when": "setup", "outcome": "passed", "duration": 0.1, "reason": ""},
        {"nodeid": "t.py::ok", "when": "call", "outcome": "passed", "duration": 1.2, "reason": ""},
        {"nodeid": "t.py::ok", "when": "teardown", "outcome": "passed", "duration": 0.1, "reason": ""},
        {"nodeid": "t.py::skip", "when": "setup", "outcome": "skipped", "duration": 0.0, "reason": "no NVIDIA GPU"},
        {"nodeid": "t.py::skip", "when": "teardown", "outcome": "passed", "duration": 0.0, "reason": ""},
        {"nodeid": "t.py::bad", "when": "call", "outcome": "failed", "duration": 2.0, "reason": "assert 1 == 2"},
        {"nodeid": "t.py::bad", "when": "teardown", "outcome": "passed", "duration": 0.0, "reason": ""},
        {"nodeid": "t.py::broken", "when": "setup", "outcome": "failed", "duration": 0.5, "reason": "RuntimeError: boom"},
    ]
    rows = bench.rows_of_tests(records, stopped="pytest was stopped at its time box of 200 s")
    assert [(r["check"], r["status"]) for r in rows] == [
        ("test t.py::ok", "passed"),
        ("test t.py::skip", "skipped"),
        ("test t.py::bad", "failed"),
        ("test t.py::broken", "failed"),
        ("test t.py::late", "not run"),
    ]
    assert rows[0]["seconds"] == pytest.approx(1.4)
    assert rows[1]["note"] == "no NVIDIA GPU"
    assert rows[2]["note"] == "assert 1 == 2"
    assert rows[3]["note"] == "error in setup: RuntimeError: boom"
    assert rows[4]["note"] == "pytest was stopped at its time box of 200 s" and rows[4]["seconds"] is None


def test_step_rows_read_the_scripts_lines():
    rows = bench.step_rows("GPU present\tpassed\t0\tH100\n\nsetup: x\tnot run\t\twhy\nodd\tweird\t1.5\t\n")
    assert rows == [
        {"check": "GPU present", "status": "passed", "seconds": 0.0, "note": "H100"},
        {"check": "setup: x", "status": "not run", "seconds": None, "note": "why"},
        {"check": "odd", "status": "failed", "seconds": 1.5, "note": ""},
    ]


def test_the_document_counts_every_row_and_is_json():
    steps = bench.step_rows("GPU present\tpassed\t0\tH100\n")
    tests = bench.rows_of_tests([{"nodeid": "t.py::a", "when": "call", "outcome": "passed", "duration": 1.0, "reason": ""}])
    measure = bench.complete_measure({"copy": MEASURE["copy"], "sizes": MEASURE["sizes"][:1]}, [1, 4, 16], "")
    assert [s["gib"] for s in measure["sizes"]] == [1, 4, 16]
    assert measure["sizes"][2] == {"gib": 16, "status": "not run", "reason": "the measurement ended before this size (see measure.log)"}
    report = bench.build_report(steps, tests, measure, {"driver": "570.86.15"})
    assert report["gpu"] is True and report["meta"] == {"driver": "570.86.15"}
    assert report["summary"] == {"passed": 5, "failed": 0, "skipped": 0, "not run": 2}
    assert json.loads(json.dumps(report)) == report
    assert bench.summary_line(report) == "gpu-check: 5 passed, 0 failed, 0 skipped, 2 not run"
    missing = bench.complete_measure(None, [1, 4], "the setup failed")
    assert missing["copy"] == {"status": "not run", "note": "the setup failed"}
    assert [s["status"] for s in missing["sizes"]] == ["not run", "not run"]


def test_report_prints_one_table_writes_the_json_and_fails_on_a_failed_row(tmp_path):
    (tmp_path / "steps.tsv").write_text("GPU present\tpassed\t0\tH100\n")
    (tmp_path / "tests.jsonl").write_text(
        json.dumps({"collected": ["t.py::a"]}) + "\n"
        + json.dumps({"nodeid": "t.py::a", "when": "call", "outcome": "passed", "duration": 1.0, "reason": ""}) + "\n"
    )
    (tmp_path / "measure.json").write_text(json.dumps(MEASURE))
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "report", "--out", str(out), "--steps", str(tmp_path / "steps.tsv"),
         "--tests", str(tmp_path / "tests.jsonl"), "--measure", str(tmp_path / "measure.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1, done.stderr  # the 4 GiB restore failed
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("| check | status |")
    assert sum(line.startswith("| ") for line in lines) == 2 + 1 + 1 + 2 + 3
    assert lines[-1] == "gpu-check: 5 passed, 1 failed, 1 skipped, 0 not run"
    document = json.loads(out.read_text())
    assert document["measurement"]["device"]["name"] == "NVIDIA H100 80GB HBM3"
    assert [row["check"] for row in document["rows"]][:2] == ["GPU present", "test t.py::a"]


def test_the_pytest_plugin_records_each_test(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(
        """
        import pytest

        def test_ok():
            pass

        def test_skipped():
            pytest.skip("no NVIDIA GPU here")

        def test_fails():
            assert 1 == 2, "one is not two"
        """
    ))
    results = tmp_path / "results.jsonl"
    env = {**os.environ, "GPU_CHECK_RESULTS": str(results), "PYTHONPATH": str(BENCH.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "gpu_checkpoint", "-p", "no:cacheprovider", "-q",
         "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    records = [json.loads(line) for line in results.read_text().splitlines()]
    rows = {row["check"].split("::")[-1]: row for row in bench.rows_of_tests(records)}
    assert rows["test_ok"]["status"] == "passed"
    assert rows["test_skipped"]["status"] == "skipped" and rows["test_skipped"]["note"] == "no NVIDIA GPU here"
    assert rows["test_fails"]["status"] == "failed" and "one is not two" in rows["test_fails"]["note"]
