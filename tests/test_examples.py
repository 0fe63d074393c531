"""The example notebook runs top to bottom, and binder's start-up configuration is the simulated one.

The notebook runs with nbclient on a kernel that a real ``jupyter server`` with the extension
started from the ``python3-gpu`` kernelspec (as JupyterLab would), so the scheduler knows the
kernel, lazy binding happens through the provisioner and the agent, and the magics talk to the
real REST API.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, ServerProcess, free_port

EXAMPLE = ROOT / "examples" / "gpu-tour.ipynb"
BINDER = ROOT / "binder"
KERNEL = "python3-gpu"
UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class ServerKernel:
    """A kernel the Jupyter server started, in the shape nbclient expects of a kernel manager.

    nbclient talks to the kernel over ZMQ with the connection file the server wrote; whether the
    kernel lives and interrupts go through the server's REST API. The server owns the kernel, so
    nbclient leaves it running and the test shuts it down through the server.
    """

    has_kernel = True

    def __init__(self, server: ServerProcess, kernel_id: str, connection_file: Path) -> None:
        self.server = server
        self.kernel_id = kernel_id
        self.connection_file = connection_file

    def client(self):
        from jupyter_client.asynchronous import AsyncKernelClient

        kc = AsyncKernelClient()
        kc.load_connection_file(str(self.connection_file))
        return kc

    async def is_alive(self) -> bool:
        try:
            self.server.call("GET", f"api/kernels/{self.kernel_id}")
            return True
        except urllib.error.HTTPError:
            return False

    async def interrupt_kernel(self) -> None:
        self.server.call("POST", f"api/kernels/{self.kernel_id}/interrupt")


def _text(output: dict) -> str:
    if output["output_type"] == "stream":
        return output["text"]
    if output["output_type"] == "error":
        return f"{output['ename']}: {output['evalue']}"
    return output.get("data", {}).get("text/plain", "")


def _cell_text(cell) -> str:
    return "".join(_text(o) for o in cell.get("outputs", []))


def _find(nb, source_start: str, exact: bool = False):
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if cell.source == source_start or (not exact and cell.source.startswith(source_start)):
            return cell
    raise AssertionError(f"the example has no code cell starting with {source_start!r}")


@pytest.fixture
def server(tmp_path):
    # The kernelspec a user installs with the CLI, into the server's data directory.
    env_dirs = {"JUPYTER_DATA_DIR": str(tmp_path / "data")}
    subprocess.run(
        [sys.executable, "-m", "jupyter_gpusched.cli", "kernelspec", "install", "--name", KERNEL,
         "--gpus", "1", "--bind", "lazy", "--user"],
        env={**os.environ, **env_dirs},
        check=True,
        capture_output=True,
    )
    assert (tmp_path / "data" / "kernels" / KERNEL / "kernel.json").exists()
    proc = ServerProcess(tmp_path, str(tmp_path / "ledger.sqlite"), free_port())
    yield proc
    try:
        for kernel in proc.call("GET", "api/kernels")[1]:
            proc.call("DELETE", f"api/kernels/{kernel['id']}")
    except OSError:
        pass
    proc.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_tour_runs_top_to_bottom(server, tmp_path, jp_asyncio_loop):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(EXAMPLE, as_version=4)
    assert nb.metadata.kernelspec.name == KERNEL
    # A notebook session, as JupyterLab opens one: the scheduler learns the notebook's name.
    _, session = server.call(
        "POST",
        "api/sessions",
        {"path": EXAMPLE.name, "name": EXAMPLE.name, "type": "notebook", "kernel": {"name": KERNEL}},
    )
    kernel = session["kernel"]
    connection_file = tmp_path / "runtime" / f"kernel-{kernel['id']}.json"
    assert connection_file.exists(), "the server wrote no connection file for its kernel"

    client = NotebookClient(
        nb,
        km=ServerKernel(server, kernel["id"], connection_file),
        kernel_name=KERNEL,
        timeout=90,
        startup_timeout=60,
    )
    # Raises CellExecutionError, naming the cell, if any cell fails.
    jp_asyncio_loop.run_until_complete(client.async_execute())
    nbformat.write(nb, tmp_path / "gpu-tour.executed.ipynb")

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code_cells), "some code cells did not run"
    errors = [o for c in code_cells for o in c.outputs if o["output_type"] == "error"]
    assert not errors, errors
    status = server.call("GET", "api/gpusched/status")[1]
    uuids = {d["uuid"] for d in status["devices"]}

    # Lazy binding: the first cell ran with a GPU of the server in CUDA_VISIBLE_DEVICES.
    first = _find(nb, "import os")
    printed = "".join(o["text"] for o in first.outputs if o["output_type"] == "stream")
    seen = UUID.findall(printed)
    assert printed.startswith("CUDA_VISIBLE_DEVICES = GPU-") and len(seen) == 1, printed
    assert seen[0] in uuids
    # ... and the agent said which GPU it bound before the cell ran.
    assert "This kernel uses GPU" in _cell_text(first) and seen[0] in _cell_text(first)

    # %gpu and %gpu status --all: this kernel's lease and the host's GPUs.
    assert "This kernel holds GPU" in _cell_text(_find(nb, "%load_ext jupyter_gpusched\n%gpu", exact=True))
    index = next(d["index"] for d in status["devices"] if d["uuid"] == seen[0])
    table = _cell_text(_find(nb, "%gpu status --all"))
    assert table.startswith(f"This kernel holds GPU {index} "), table
    for device in status["devices"]:
        # One row per GPU: index, name, ..., who holds it.
        holder = "this kernel" if device["index"] == index else "free"
        row = rf"^{device['index']}\s+{re.escape(device['name'])}\s.*\s{holder}$"
        assert re.search(row, table, re.M), (row, table)
    # --all adds the leases: this kernel's, on that GPU.
    assert re.search(rf"^[0-9a-f]{{32}}\s+this kernel\s+GPU {index}\s.*\sactive\s", table, re.M), table

    # gpu.status(): the lease, on the device the first cell saw.
    api_out = _cell_text(_find(nb, "from jupyter_gpusched import gpu"))
    assert re.search(r"This kernel's lease \w+ is (active|idle) on GPU \d", api_out), api_out
    assert "4.0 GiB of GPU memory held" in _cell_text(_find(nb, "from jupyter_gpusched.devices"))
    assert "kept for 30m" in _cell_text(_find(nb, "%gpu keep")).replace("30m00s", "30m")

    # The panel is an ipywidgets view, and nbclient saved the widget state with the notebook.
    panel = _find(nb, "%gpu panel")
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in panel.outputs)
    assert "application/vnd.jupyter.widget-state+json" in nb.metadata.get("widgets", {})

    assert "Released GPU" in _cell_text(_find(nb, "if holding:"))
    block = _cell_text(_find(nb, "if gpu.has_scheduler:\n    with gpu.lease(1)"))
    inside = UUID.findall(block.split("after the block")[0])
    assert inside and inside[0] in uuids, block
    assert "after the block: None" in block, block

    # At the end the kernel holds nothing, as the notebook's last cells say.
    mine = [le for le in status["leases"] if le["kernel_id"] == kernel["id"] and le["state"] != "released"]
    assert mine == [], mine


# -- without a scheduler -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kernel_name", [KERNEL, "python3"])
def test_gpu_tour_runs_headless_where_no_scheduler_serves_the_kernel(server, tmp_path, kernel_name):
    """``jupyter nbconvert --execute`` starts the kernel itself: no scheduler serves it.

    A server with the extension runs on the host all the same (its runtime files are where the
    kernel looks): the kernel must not show that server's GPUs as its own. With the GPU
    kernelspec the provisioner finds no scheduler in nbconvert's process; with a plain ipykernel
    the tour loads the agent itself.
    """
    import nbformat

    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
    }
    out = tmp_path / "headless.ipynb"
    done = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
         f"--ExecutePreprocessor.kernel_name={kernel_name}", "--ExecutePreprocessor.timeout=90",
         "--output", str(out), str(EXAMPLE)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    nb = nbformat.read(out, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code_cells)
    assert not [o for c in code_cells for o in c.outputs if o["output_type"] == "error"]

    status = _cell_text(_find(nb, "%load_ext jupyter_gpusched\n%gpu", exact=True))
    # Said once, with why; the host's GPUs (the other server's) are not listed as this kernel's.
    assert status.startswith("No GPU scheduler for this kernel, so it has no GPU. No running Jupyter server runs this kernel")
    everything = "\n".join(_cell_text(c) for c in code_cells)
    assert everything.count("No running Jupyter server runs this kernel") == 1
    assert "H100" not in everything and "free" not in everything
    assert "No GPU scheduler for this kernel, so there is no GPU to keep." in _cell_text(_find(nb, "%gpu keep"))
    assert "No GPU scheduler serves this kernel" in _cell_text(_find(nb, "from jupyter_gpusched import gpu"))
    assert "already loaded" not in everything
    # The scheduler next door gave this kernel nothing.
    assert server.call("GET", "api/gpusched/status")[1]["leases"] == []


# -- binder --------------------------------------------------------------------------------------
def test_binder_config_selects_simulated_gpus():
    from traitlets.config.loader import PyFileConfigLoader

    from jupyter_gpusched.server.app import GPUSchedApp

    config = PyFileConfigLoader("jupyter_server_config.py", path=str(BINDER)).load_config()
    # The extension accepts it as it stands (its traits validate the values).
    app = GPUSchedApp(config=config)
    assert app.backend == "simulated"
    assert app.simulated_devices == 4


@pytest.mark.slow
def test_binder_start_runs_a_server_on_simulated_gpus(tmp_path):
    """``binder/start`` as Binder runs it, wrapping the server command: 4 simulated GPUs."""
    port = free_port()
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
    }
    env.pop("JUPYTER_CONFIG_PATH", None)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [
            str(BINDER / "start"),
            sys.executable, "-m", "jupyter_server",
            f"--port={port}", "--ip=127.0.0.1", "--no-browser", "--allow-root",
            "--IdentityProvider.token=binder-test", f"--ServerApp.root_dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/gpusched/status",
            headers={"Authorization": "token binder-test"},
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                with opener.open(request, timeout=10) as resp:
                    status = json.loads(resp.read())
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.3)
        assert status["backend"] == "simulated"
        assert len(status["devices"]) == 4
        assert all(d["health"] == "ok" for d in status["devices"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def test_binder_build_installs_the_package_and_the_gpu_kernelspec():
    post_build = BINDER / "postBuild"
    start = BINDER / "start"
    for script in (post_build, start):
        assert script.read_text().startswith("#!"), script
        assert script.stat().st_mode & 0o111, f"{script} must be executable"
    text = post_build.read_text()
    assert re.search(r"^python -m pip install [^\n]*\.$", text, re.M), text
    assert re.search(r"jupyter gpusched kernelspec install --name python3-gpu\b", text), text
    assert "--sys-prefix" in text
    # The example notebook asks for that kernelspec.
    import nbformat

    assert nbformat.read(EXAMPLE, as_version=4).metadata.kernelspec.name == "python3-gpu"
    environment = (BINDER / "environment.yml").read_text()
    assert re.search(r"^\s*-\s*nodejs\b", environment, re.M), "the lab extension build needs Node.js"
    assert re.search(r"^\s*-\s*jupyterlab\b", environment, re.M)
