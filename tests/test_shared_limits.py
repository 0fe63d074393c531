"""A shared lease's memory share, set where the frameworks read it, and MPS where there is one.

The end-to-end tests run real ipykernel kernels, started through gpusched-provisioner, on 2
simulated 80 GiB GPUs; the PyTorch one imports the real torch (a CPU build: CUDA never
initializes, so the queued fraction is seen waiting in torch's own queue).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from traitlets import TraitError

from conftest import live_lease
from jupyter_gpusched.kernel import limits as L
from jupyter_gpusched.kernel import render
from jupyter_gpusched.server.mps import MPS

GiB = 1024**3
HAS_TORCH = importlib.util.find_spec("torch") is not None
NO_TORCH = "torch is not installed in this environment (pip install torch, a CPU build is enough)"

SHOW_ENV = (
    "import os, sys, json\n"
    f"names = {list(L.LIMIT_VARS)!r}\n"
    "print('ENV=' + json.dumps({n: os.environ.get(n) for n in names}))\n"
    "print('IMPORTED=' + json.dumps(sorted(m for m in ('torch', 'cupy', 'jax', 'tensorflow') if m in sys.modules)))\n"
)


def _printed(out: dict, key: str):
    assert out["error"] is None, out
    for line in out["stdout"].splitlines():
        if line.startswith(key + "="):
            return json.loads(line.split("=", 1)[1])
    raise AssertionError(f"no {key}= printed: {out}")


def _said(out: dict) -> str:
    return out["stdout"] + "\n".join(out["display"])


# -- the limits, from a lease ---------------------------------------------------------------------
ABSENT = L.MpsInfo("absent", "no MPS on this host: nvidia-cuda-mps-control is not on PATH")
RUNNING = L.MpsInfo("running", "MPS control daemons for 2 GPU(s)", {"GPU-a": {"pipe": "/r/a/pipe", "log": "/r/a/log"}})


def _lease(**kw):
    return {"id": "l1", "state": "active", "mode": "shared", "memory": 16 * GiB, "devices": ["GPU-a"], **kw}


def test_an_exclusive_lease_or_a_whole_gpu_has_no_limits():
    assert L.limits_for(_lease(mode="exclusive"), {"GPU-a": 80 * GiB}, ABSENT) is None
    assert L.limits_for(_lease(memory=None), {"GPU-a": 80 * GiB}, ABSENT) is None
    assert L.limits_for(_lease(devices=[]), {}, ABSENT) is None
    assert L.limits_for(None, {}, ABSENT) is None


def test_a_shared_lease_sets_each_frameworks_own_variable():
    limits = L.limits_for(_lease(), {"GPU-a": 80 * GiB}, ABSENT)
    assert limits.environment() == {
        "CUPY_GPU_MEMORY_LIMIT": str(16 * GiB),
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2000",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    text = limits.describe()
    assert "Memory limit 16.0 GiB per GPU" in text
    assert "PyTorch per-process fraction, CuPy, JAX" in text
    assert "advisory" in text and "no MPS on this host" in text


def test_jax_fraction_is_of_the_smallest_gpu_and_rounded_down():
    limits = L.limits_for(
        _lease(devices=["GPU-a", "GPU-b"], memory=10 * GiB), {"GPU-a": 80 * GiB, "GPU-b": 30 * GiB}, ABSENT
    )
    assert limits.environment()["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3333"
    unknown = L.limits_for(_lease(), {}, ABSENT)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in unknown.environment()
    assert "JAX" not in unknown.describe()


def test_an_mps_client_gets_the_daemons_directories_and_a_pinned_limit():
    limits = L.limits_for(_lease(memory=12 * GiB + 512 * 1024**2), {"GPU-a": 80 * GiB}, RUNNING)
    env = limits.environment()
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/r/a/pipe"
    assert env["CUDA_MPS_LOG_DIRECTORY"] == "/r/a/log"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=12800M"
    assert L.limits_for(_lease(), {}, RUNNING).environment()["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16G"
    assert "enforced by the driver" in limits.describe()


def test_an_mps_client_gets_its_memory_shares_part_of_the_gpus_compute():
    # 16 GiB of 80 GiB: 20 %.
    limits = L.limits_for(_lease(), {"GPU-a": 80 * GiB}, RUNNING)
    assert limits.thread_percentage == 20
    assert limits.environment()["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    assert "MPS pinned device memory limit and 20% of the GPU's compute (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)" in (
        limits.describe()
    )
    # Rounded up to a whole percent, at least 1, at most 100.
    assert L.limits_for(_lease(memory=12 * GiB + 512 * 1024**2), {"GPU-a": 80 * GiB}, RUNNING).thread_percentage == 16
    assert L.limits_for(_lease(memory=1024**2), {"GPU-a": 80 * GiB}, RUNNING).thread_percentage == 1
    assert L.limits_for(_lease(memory=80 * GiB), {"GPU-a": 80 * GiB}, RUNNING).thread_percentage == 100
    assert L.limits_for(_lease(memory=10 * GiB), {"GPU-a": 40 * GiB}, RUNNING).environment()[
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
    ] == "25"
    # The GPU's memory unknown: no compute share, and status says so.
    unknown = L.limits_for(_lease(), {}, RUNNING)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in unknown.environment()
    assert "no compute share: the GPU's memory is unknown" in unknown.describe()
    # Without MPS the variable is never set.
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in L.limits_for(_lease(), {"GPU-a": 80 * GiB}, ABSENT).environment()


def test_mps_serves_single_gpu_leases_on_a_gpu_with_a_daemon():
    two = L.limits_for(_lease(devices=["GPU-a", "GPU-b"]), {}, RUNNING)
    assert two.mps is None and "single-GPU" in two.describe()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in two.environment()
    other = L.limits_for(_lease(devices=["GPU-b"]), {}, RUNNING)
    assert other.mps is None and "no MPS daemon for this GPU" in other.describe()


def test_what_the_server_says_about_mps_reaches_the_kernel():
    assert L.MpsInfo.from_environment({L.ENV_MPS: RUNNING.to_json()}) == RUNNING
    assert L.MpsInfo.from_environment({}).state == "unknown"
    assert "could not be read" in L.MpsInfo.from_environment({L.ENV_MPS: "{nope"}).reason


class _Agent:
    """What the keeper reads of the agent: the environment and a client with ``devices()``."""

    def __init__(self, environ=None, devices=()):
        self.environ = environ or {}
        self.asked = 0
        devices = list(devices)
        agent = self

        class Client:
            def devices(self):
                agent.asked += 1
                return devices

        self.client = Client()


def test_the_keeper_sets_then_restores_the_kernels_own_values(monkeypatch):
    for name in L.LIMIT_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false")
    agent = _Agent({L.ENV_MPS: ABSENT.to_json()}, [{"uuid": "GPU-a", "memory_total": 80 * GiB}])
    keeper = L.Keeper(agent.environ, agent.client.devices)
    try:
        keeper.apply(_lease())
        assert os.environ["CUPY_GPU_MEMORY_LIMIT"] == str(16 * GiB)
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2000"
        assert os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
        keeper.apply(_lease())
        assert agent.asked == 1, "the GPUs' memory is asked once"
        keeper.apply(_lease(mode="exclusive", memory=None))
        assert "CUPY_GPU_MEMORY_LIMIT" not in os.environ
        assert os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == "false", "the kernel's own value is back"
        keeper.apply(_lease(id="l2"))
        keeper.clear()
        assert [n for n in L.LIMIT_VARS if n in os.environ] == ["TF_FORCE_GPU_ALLOW_GROWTH"]
    finally:
        keeper.uninstall_torch_hook()


def test_limits_the_provisioner_set_are_not_restored_after_the_lease(monkeypatch):
    monkeypatch.setenv("CUPY_GPU_MEMORY_LIMIT", str(8 * GiB))
    agent = _Agent({L.ENV_LIMITS_SET: "CUPY_GPU_MEMORY_LIMIT"})
    keeper = L.Keeper(agent.environ, agent.client.devices)
    assert keeper.set_at_launch
    keeper.clear()
    assert "CUPY_GPU_MEMORY_LIMIT" not in os.environ


def test_status_shows_the_limit_and_what_enforces_it():
    lease = _lease()
    status = {
        "devices": [{"uuid": "GPU-a", "index": 0, "memory_total": 80 * GiB, "memory_used": 0}],
        "leases": [lease],
        "queue": [],
        "limits": L.limits_for(lease, {"GPU-a": 80 * GiB}, ABSENT).describe(),
    }
    text, html_text = render.status_report(status, None, lease, 0.0)
    assert "Memory limit 16.0 GiB per GPU: PyTorch per-process fraction, CuPy, JAX (advisory" in text
    assert "no MPS on this host" in html_text
    released = {**lease, "state": "released"}
    assert "Memory limit" not in render.status_report(status, None, released, 0.0)[0]
    # With MPS: the memory limit and the compute share, enforced by the driver.
    status["limits"] = L.limits_for(lease, {"GPU-a": 80 * GiB}, RUNNING).describe()
    text = render.status_report(status, None, lease, 0.0)[0]
    assert (
        "Memory limit 16.0 GiB per GPU: MPS pinned device memory limit and 20% of the GPU's compute "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) (enforced by the driver)"
    ) in text


def test_a_module_imported_later_runs_the_callback_after_its_own_code(tmp_path, monkeypatch):
    (tmp_path / "gpusched_probe_pkg").mkdir()
    (tmp_path / "gpusched_probe_pkg" / "__init__.py").write_text("DONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    finder = L._AfterImport("gpusched_probe_pkg", lambda m: seen.append(m.DONE))
    sys.meta_path.insert(0, finder)
    try:
        import gpusched_probe_pkg  # noqa: F401

        assert seen == [True]
        assert type(gpusched_probe_pkg.__loader__).__name__ == "SourceFileLoader"
        assert gpusched_probe_pkg.__spec__.loader is gpusched_probe_pkg.__loader__
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("gpusched_probe_pkg", None)


@pytest.mark.skipif(not HAS_TORCH, reason=NO_TORCH)
def test_torch_gets_the_fraction_queued_without_initializing_cuda():
    # A fresh interpreter, so that torch is imported after the hook as in a kernel.
    code = (
        "from jupyter_gpusched.kernel import limits as L\n"
        "k = L.Keeper({}, list)\n"
        f"k.current = L.Limits({8 * GiB}, ('GPU-a',), ({80 * GiB},))\n"
        "k.install_torch_hook()\n"
        "import torch\n"
        "mine = [c for c, _ in torch.cuda._queued_calls if getattr(c, '__self__', None) is k]\n"
        "print(len(mine), k.torch_queued, torch.cuda.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "True", "False"]


# -- MPS on the server ----------------------------------------------------------------------------
def _never(name):
    raise AssertionError(f"looked for {name} although MPS is off")


def test_mps_off_is_honoured():
    mps = MPS("off", "/run/x", which=_never)
    assert not mps.wanted and mps.state == "off" and "c.GPUSchedApp.mps" in mps.reason
    mps.start(["GPU-a"])
    assert mps.info() == {"state": "off", "reason": mps.reason, "daemons": {}}


def test_hub_mode_runs_no_mps():
    mps = MPS("auto", "/run/x", hub=True, which=_never)
    assert mps.state == "hub" and "different users" in mps.reason


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is not None, reason="this host has MPS")
def test_mps_absent_is_said_plainly(tmp_path):
    mps = MPS("auto", str(tmp_path / "mps"))
    assert mps.state == "absent"
    assert mps.reason == "no MPS on this host: nvidia-cuda-mps-control is not on PATH"
    mps.start(["GPU-a"])
    assert mps.state == "absent" and not (tmp_path / "mps").exists()


def test_mps_commands_and_each_daemons_environment(tmp_path):
    mps = MPS("auto", str(tmp_path), which=lambda name: f"/usr/bin/{name}", environ={"PATH": "/usr/bin"})
    assert mps.wanted
    assert mps.start_command() == ["/usr/bin/nvidia-cuda-mps-control", "-d"]
    assert mps.stop_command() == (["/usr/bin/nvidia-cuda-mps-control"], b"quit\n")
    uuid = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
    daemon = mps.daemon_for(uuid)
    assert daemon == mps.daemon_for(uuid) and daemon != mps.daemon_for("GPU-other")
    assert daemon.environment(mps.environ) == {
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": uuid,
        "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_directory,
        "CUDA_MPS_LOG_DIRECTORY": daemon.log_directory,
    }
    # Unix socket paths in the pipe directory stay short under a usual runtime directory.
    usual = MPS("auto", "/home/someone/.local/share/jupyter/runtime/gpusched-mps", which=lambda n: n)
    assert len(usual.daemon_for(uuid).pipe_directory) < 80
    # Under a deep runtime directory the daemon could not bind its sockets: the pipes go to a
    # private folder of this user's in the temp directory instead.
    deep = MPS("auto", "/tmp/" + "d" * 90 + "/runtime/gpusched-mps", which=lambda n: n)
    pipes = deep.daemon_for(uuid).pipe_directory
    assert len(os.path.join(pipes, "control_privileged")) <= 107
    assert oct(os.stat(os.path.dirname(os.path.dirname(pipes))).st_mode & 0o777) == "0o700"
    shutil.rmtree(deep.short_root, ignore_errors=True)  # no daemon was started to remove it
    simulated = MPS("auto", str(tmp_path), backend="simulated", which=lambda name: f"/usr/bin/{name}")
    assert not simulated.wanted and "simulated" in simulated.reason


def test_the_mps_trait_takes_auto_or_off():
    from jupyter_gpusched.server.app import GPUSchedApp

    assert GPUSchedApp().mps == "auto"
    assert GPUSchedApp(mps="off").mps == "off"
    with pytest.raises(TraitError, match="'auto' or 'off'"):
        GPUSchedApp(mps="on")


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="no nvidia-cuda-mps-control on PATH")
def test_a_real_mps_control_daemon_starts_and_quits(tmp_path):
    from jupyter_gpusched.devices.nvml import NvmlBackend

    backend = NvmlBackend()
    whole = [d for d in backend.snapshot() if not d.parent_uuid][:1]
    uuids = [d.uuid for d in whole]
    totals = {d.uuid: d.memory_total for d in whole}
    backend.close()
    mps = MPS("auto", str(tmp_path / "mps"))
    mps.start(uuids)
    try:
        assert mps.state == "running", mps.reason
        daemon = mps.daemons[uuids[0]]
        assert mps.running(daemon)
        # A client with a 4 GiB share's environment: 3 GiB fit, 2 GiB more do not.
        # With its compute share too, which the MPS server takes from the client's environment.
        limits = L.limits_for(_lease(memory=4 * GiB, devices=uuids), totals, L.MpsInfo(**mps.info()))
        env = {**os.environ, **limits.environment(), "CUDA_VISIBLE_DEVICES": uuids[0]}
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(-(-400 * GiB // totals[uuids[0]]))
        done = subprocess.run([sys.executable, "-c", MPS_CLIENT], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.split() == ["0", "2"], (done.stdout, done.stderr)  # 2: CUDA_ERROR_OUT_OF_MEMORY
    finally:
        mps.stop()
    assert not mps.daemons and not mps.running(daemon)


MPS_CLIENT = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cuda.cuCtxSetCurrent(ctx) == 0
a, b = ctypes.c_uint64(), ctypes.c_uint64()
print(cuda.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(3 << 30)))
print(cuda.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(2 << 30)))
"""


# -- real kernels ---------------------------------------------------------------------------------
@pytest.mark.slow
async def test_a_shared_lease_sets_limits_before_the_first_cell_and_clears_them(
    jp_fetch, gpu_kernelspec, start_kernel
):
    gpu_kernelspec("shared", mode="shared", memory="16GiB")
    k = await start_kernel("shared")
    out = await k.execute(SHOW_ENV)
    env = _printed(out, "ENV")
    assert _printed(out, "IMPORTED") == [], "no framework is imported by the scheduler"
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(16 * GiB)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2000"  # 16 GiB of an 80 GiB GPU
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] is None, "no MPS on this host"
    lease = await live_lease(jp_fetch, k.id)
    assert lease["mode"] == "shared" and lease["memory"] == 16 * GiB

    said = _said(await k.execute("%gpu status"))
    assert "Memory limit 16.0 GiB per GPU: PyTorch per-process fraction, CuPy, JAX" in said
    assert "no MPS on this host" in said

    if HAS_TORCH:
        out = await k.execute(
            "import torch\n"
            "from jupyter_gpusched.kernel.agent import existing_agent\n"
            "keeper = existing_agent().limits\n"
            "mine = [c for c, _ in torch.cuda._queued_calls if getattr(c, '__self__', None) is keeper]\n"
            "print('TORCH=' + json.dumps([len(mine), torch.cuda.is_initialized()]))",
            timeout=120,
        )
        assert _printed(out, "TORCH") == [1, False], "queued for CUDA's initialization, which has not happened"
        assert "queued for its CUDA initialization" in _said(await k.execute("%gpu status"))

    await k.execute("%gpu release")
    env = _printed(await k.execute(SHOW_ENV), "ENV")
    assert all(env[name] is None for name in L.LIMIT_VARS), env


@pytest.mark.slow
async def test_an_exclusive_lease_has_no_limits(gpu_kernelspec, start_kernel):
    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    out = await k.execute(SHOW_ENV + "print('MPS=' + os.environ['JUPYTER_GPUSCHED_MPS'])")
    assert all(value is None for value in _printed(out, "ENV").values())
    assert "Memory limit" not in _said(await k.execute("%gpu status"))
    mps = _printed(out, "MPS")
    if shutil.which("nvidia-cuda-mps-control") is None:
        assert mps["state"] == "absent" and "no MPS on this host" in mps["reason"]


@pytest.mark.slow
async def test_a_shared_lease_bound_at_launch_starts_with_its_limits(gpu_kernelspec, start_kernel, sched_config):
    gpu_kernelspec("shared-launch", mode="shared", memory="8GiB", bind="launch")
    k = await start_kernel("shared-launch")
    out = await k.execute(SHOW_ENV + "print('MPS=' + os.environ['JUPYTER_GPUSCHED_MPS'])")
    env = _printed(out, "ENV")
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(8 * GiB)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.1000"
    # Then the kernel asks for an exclusive GPU instead: the limits go.
    await k.execute("%gpu release")
    out = await k.execute("%gpu acquire 1 --exclusive")
    assert out["error"] is None, out
    assert all(value is None for value in _printed(await k.execute(SHOW_ENV), "ENV").values())


@pytest.fixture
def mps_off(sched_config):
    sched_config["mps"] = "off"


@pytest.mark.slow
async def test_mps_off_is_what_the_kernel_is_told(mps_off, gpu_kernelspec, start_kernel):
    gpu_kernelspec("shared", mode="shared", memory="16GiB")
    k = await start_kernel("shared")
    await k.execute("1")
    said = _said(await k.execute("%gpu status"))
    assert "Memory limit 16.0 GiB per GPU" in said and "MPS is off (c.GPUSchedApp.mps = 'off')" in said
