"""``jupyter gpusched`` against a real server: status, release, drain, kernelspec install."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ServerProcess, free_port
from jupyter_gpusched import core

pytestmark = pytest.mark.slow


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpusched.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def server(tmp_path):
    proc = ServerProcess(tmp_path, str(tmp_path / "ledger.sqlite"), free_port())
    yield proc
    proc.stop()


def test_status_release_and_drain(server):
    target = ["--url", f"http://127.0.0.1:{server.port}/", "--token", server.token]
    _, kernel = server.call("POST", "api/kernels", {"name": "python3"})
    _, lease = server.call("POST", "api/gpusched/leases", {"kernel_id": kernel["id"]})

    done = run_cli("status", *target)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "simulated backend, hybrid policy" in text
    assert lease["id"][:12] in text and "active" in text and "free" in text
    import psutil

    half = core.format_bytes(psutil.virtual_memory().total // 2)
    assert f"checkpoints hold 0 B of host memory, of {half} (checkpoint_host_memory)" in text

    done = run_cli("status", "--json", *target)
    status = json.loads(done.stdout)
    assert status["devices"][0]["name"] in text
    assert [le["id"] for le in status["leases"]] == [lease["id"]]

    done = run_cli("drain", status["devices"][1]["uuid"], "--reason", "fan", *target)
    assert done.returncode == 0 and "drained" in done.stdout
    _, status = server.call("GET", "api/gpusched/status")
    assert status["devices"][1]["health"] == "drained"
    done = run_cli("drain", status["devices"][1]["uuid"], "--undo", *target)
    assert done.returncode == 0 and "ok" in done.stdout

    done = run_cli("release", lease["id"][:8], *target)
    assert done.returncode == 0, done.stderr
    assert f"released lease {lease['id']}" in done.stdout
    _, got = server.call("GET", f"api/gpusched/leases/{lease['id']}")
    assert got["state"] == "released"

    done = run_cli("release", "nosuchlease", *target)
    assert done.returncode == 1 and "no lease 'nosuchlease'" in done.stderr
    done = run_cli("drain", "GPU-nope", *target)
    assert done.returncode == 1 and "404" in done.stderr


def test_status_finds_the_running_server_by_itself(server, tmp_path):
    env = {"JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    done = run_cli("status", env=env)
    assert done.returncode == 0, done.stderr
    assert "simulated backend" in done.stdout


def test_no_server_is_a_clear_error(tmp_path):
    done = run_cli("status", env={"JUPYTER_RUNTIME_DIR": str(tmp_path)})
    assert done.returncode == 1
    assert "no running Jupyter server with the GPU scheduler" in done.stderr


def test_kernelspec_install_writes_a_provisioned_spec(tmp_path):
    done = run_cli(
        "kernelspec", "install", "--name", "py-gpu", "--gpus", "2", "--memory", "16GiB", "--bind", "launch",
        "--prefix", str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "py-gpu" / "kernel.json").read_text())
    prov = spec["metadata"]["kernel_provisioner"]
    assert prov["provisioner_name"] == "gpusched-provisioner"
    assert prov["config"] == {"gpus": 2, "bind": "launch", "mode": "exclusive", "memory": "16GiB"}
    assert "ipykernel_launcher" in spec["argv"]
    assert spec["display_name"] == "Python 3 (2 GPUs, 16GiB, launch)"
    done = run_cli(
        "kernelspec", "install", "--name", "py-shared", "--mode", "shared", "--memory", "16GiB", "--prefix", str(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "py-shared" / "kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (1 GPU, shared 16GiB, lazy)", "the launcher says what a kernel gets"
    done = run_cli("kernelspec", "install", "--name", "bad", "--memory", "lots", "--prefix", str(tmp_path))
    assert done.returncode == 1 and "memory" in done.stderr


def run_without(module: str, *args: str) -> subprocess.CompletedProcess:
    """``jupyter gpusched ARGS`` in a Python where ``module`` cannot be imported (as if not installed)."""
    wrapper = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from jupyter_gpusched.cli import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", wrapper, *args], capture_output=True, text=True, timeout=120
    )


def test_broker_without_jupyterhub_says_what_to_install():
    done = run_without("jupyterhub", "broker")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr
    assert "needs JupyterHub" in done.stderr and "pip install jupyterhub" in done.stderr
    # Its settings can still be read.
    done = run_without("jupyterhub", "broker", "--help-all")
    assert done.returncode == 0 and "GPUBroker" in done.stdout
