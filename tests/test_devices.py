"""The device backends: one contract for every backend, then what only simulated GPUs do.

The contract runs on simulated GPUs everywhere and on the host's real GPUs with ``-m gpu``.
NVML is never faked: without a GPU the ``nvml`` cases skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from jupyter_gpusched.core.model import GiB, Health
from jupyter_gpusched.core.placement import schedulable
from jupyter_gpusched.devices import DeviceLost, DeviceSnapshot, InventoryUnavailable, open_backend
from jupyter_gpusched.devices import simulated
from jupyter_gpusched.devices.simulated import (
    STATE_ENV,
    SimulatedBackend,
    SimulatedCudaError,
    SimulatedOutOfMemory,
    parse_devices,
)

#: Two plain GPUs on one NVLink, one split into MIG instances, one of another model.
SIM_CONFIG = [
    {"name": "NVIDIA H100 80GB HBM3", "memory": "80GiB", "nvlink_group": "nvlink-0", "numa_node": 0},
    {"name": "NVIDIA H100 80GB HBM3", "memory": "80GiB", "nvlink_group": "nvlink-0", "numa_node": 0},
    {"name": "NVIDIA A100-SXM4-40GB", "memory": 40 * GiB, "mig": ["3g.20gb", "4g.20gb"], "numa_node": 1},
    {"name": "NVIDIA L4", "memory": "24GiB"},
]


def _open_nvml():
    try:
        return open_backend("nvml")
    except InventoryUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimulatedBackend]:
    backend = SimulatedBackend(SIM_CONFIG, state_path=str(tmp_path / "sim.sqlite"))
    yield backend
    backend.close()


@pytest.fixture(params=["simulated", pytest.param("nvml", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "nvml":
        backend = _open_nvml()
    else:
        backend = SimulatedBackend(SIM_CONFIG, state_path=str(tmp_path / "sim.sqlite"))
        # Something for the per-process fields to describe.
        backend.add_process(backend.devices[0].uuid, os.getpid(), "6GiB", utilization=40)
    yield backend
    backend.close()


@pytest.fixture
def kernel_env(sim: SimulatedBackend, monkeypatch: pytest.MonkeyPatch):
    """This test process as a kernel bound to simulated GPU 0."""
    monkeypatch.setenv(STATE_ENV, sim.state_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", sim.devices[0].uuid)
    yield sim
    simulated.free()


def _by_uuid(snapshot: tuple[DeviceSnapshot, ...]) -> dict[str, DeviceSnapshot]:
    return {d.uuid: d for d in snapshot}


def _kernel_script(body: str) -> str:
    return "import sys\nfrom jupyter_gpusched.devices import simulated\n" + textwrap.dedent(body) + (
        "\nprint('ready', flush=True)\nsys.stdin.read()\n"
    )


@contextmanager
def _kernel(sim: SimulatedBackend, uuid: str, body: str) -> Iterator[subprocess.Popen]:
    """Another process that uses ``uuid`` as its CUDA device, running ``body`` and then waiting."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, STATE_ENV: sim.state_path}
    proc = subprocess.Popen(
        [sys.executable, "-c", _kernel_script(body)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"kernel process failed: {line}{err}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


# -- the contract, for every backend -----------------------------------------------------------


def test_uuids_and_indexes_are_stable_across_snapshots(backend):
    first, second = backend.snapshot(), backend.snapshot()
    assert [(d.uuid, d.index) for d in first] == [(d.uuid, d.index) for d in second]
    assert len({d.uuid for d in first}) == len(first)
    assert len({d.index for d in first}) == len(first)
    for device in first:
        assert device.uuid.startswith("MIG-" if device.parent_uuid else "GPU-")


def test_memory_and_utilization_are_in_range_where_known(backend):
    for device in backend.snapshot():
        assert device.memory_total > 0, device.uuid
        if device.memory_used is not None:
            assert 0 <= device.memory_used <= device.memory_total, device.uuid
        if device.utilization is not None:
            assert 0 <= device.utilization <= 100, device.uuid
        assert device.health in ("ok", "lost")
        assert device.numa_node is None or device.numa_node >= 0
        assert device.architecture is None or device.architecture.strip()


def test_processes_have_pids_and_plausible_usage(backend):
    for device in backend.snapshot():
        pids = [p.pid for p in device.processes]
        assert len(set(pids)) == len(pids), device.uuid
        for proc in device.processes:
            assert isinstance(proc.pid, int) and proc.pid > 0
            if proc.memory_used is not None:
                assert 0 <= proc.memory_used <= device.memory_total
            if proc.utilization is not None:
                assert 0 <= proc.utilization <= 100


def test_to_core_maps_every_field(backend):
    for device in backend.snapshot():
        core = device.to_core()
        assert (core.uuid, core.index, core.name, core.memory_total) == (
            device.uuid,
            device.index,
            device.name,
            device.memory_total,
        )
        assert (core.group, core.parent) == (device.nvlink_group, device.parent_uuid)
        assert (core.utilization, core.memory_used) == (device.utilization, device.memory_used)
        assert core.health == (Health.LOST if device.lost else Health.OK)
        assert device.to_core(drained=True).health == (Health.LOST if device.lost else Health.DRAINED)


def test_mig_instances_name_a_parent_that_is_not_schedulable(backend):
    snapshot = backend.snapshot()
    devices = _by_uuid(snapshot)
    physical = [d for d in snapshot if d.parent_uuid is None]
    instances = [d for d in snapshot if d.parent_uuid is not None]
    assert all(d.mig_profile is None for d in physical)
    for inst in instances:
        parent = devices[inst.parent_uuid]
        assert parent.parent_uuid is None
        assert inst.index > max(d.index for d in physical)
        assert inst.nvlink_group is None
    for parent in physical:
        kids = [i for i in instances if i.parent_uuid == parent.uuid]
        assert sum(k.memory_total for k in kids) <= parent.memory_total
    placeable = {d.uuid for d in schedulable([d.to_core() for d in snapshot])}
    assert not placeable & {i.parent_uuid for i in instances}


# -- faults, on backends that can script them --------------------------------------------------


def test_a_lost_gpu_is_reported_lost_and_the_others_still_answer(backend):
    if not hasattr(backend, "lose"):
        pytest.skip(f"the {backend.name} backend cannot lose a GPU on purpose")
    target = backend.snapshot()[1]
    backend.lose(target.uuid)
    snapshot = _by_uuid(backend.snapshot())
    lost = snapshot[target.uuid]
    assert lost.health == "lost" and lost.to_core().health == Health.LOST
    assert (lost.memory_used, lost.utilization, lost.processes) == (None, None, ())
    assert [d.uuid for d in snapshot.values() if d.lost] == [target.uuid]
    assert target.uuid not in {d.uuid for d in schedulable([d.to_core() for d in snapshot.values()])}

    backend.restore_device(target.uuid)
    assert _by_uuid(backend.snapshot())[target.uuid].health == "ok"


def test_unsupported_fields_read_none(backend):
    if not hasattr(backend, "unsupported"):
        pytest.skip(f"the {backend.name} backend cannot switch fields off")
    for field in ("process_utilization", "process_memory", "utilization", "numa_node"):
        backend.unsupported(field)
    snapshot = backend.snapshot()
    held = [p for d in snapshot for p in d.processes]
    assert held and all(p.utilization is None and p.memory_used is None for p in held)
    assert all(d.utilization is None and d.numa_node is None for d in snapshot)
    assert all(d.memory_used is not None for d in snapshot)  # still supported

    backend.supported("process_utilization")
    assert [p.utilization for d in backend.snapshot() for p in d.processes] == [40.0]


# -- simulated GPUs ----------------------------------------------------------------------------


def test_another_process_allocates_and_the_server_sees_it(sim):
    gpu = sim.devices[1].uuid
    body = """
        simulated.allocate("12GiB")
        simulated.allocate(4 * 1024**3)
        simulated.set_utilization(70)
    """
    with _kernel(sim, gpu, body) as proc:
        device = _by_uuid(sim.snapshot())[gpu]
        assert [(p.pid, p.memory_used, p.utilization) for p in device.processes] == [(proc.pid, 16 * GiB, 70.0)]
        assert device.memory_used == 16 * GiB
        assert device.utilization == 70.0
        assert all(not d.processes for d in sim.snapshot() if d.uuid != gpu)


def test_a_killed_process_disappears_and_its_memory_is_free(sim):
    gpu = sim.devices[0].uuid
    with _kernel(sim, gpu, 'simulated.allocate("70GiB")') as proc:
        assert [p.pid for p in _by_uuid(sim.snapshot())[gpu].processes] == [proc.pid]
        proc.kill()
        proc.wait(timeout=10)
        device = _by_uuid(sim.snapshot())[gpu]
        assert device.processes == () and device.memory_used == 0
    sim.add_process(gpu, os.getpid(), "70GiB")  # the room is back


def test_allocation_past_memory_total_is_refused_like_an_oom(sim, kernel_env):
    gpu = sim.devices[0].uuid
    with _kernel(sim, gpu, 'simulated.allocate("60GiB")') as other:
        assert simulated.allocate("10GiB") == gpu
        with pytest.raises(SimulatedOutOfMemory) as excinfo:
            simulated.allocate("20GiB")
        message = str(excinfo.value)
        assert "out of memory" in message and "20.0 GiB" in message and "70.0 GiB in use" in message
        assert simulated.memory_allocated() == 10 * GiB  # a refused allocation takes nothing
        held = {p.pid: p.memory_used for p in _by_uuid(sim.snapshot())[gpu].processes}
        assert held == {other.pid: 60 * GiB, os.getpid(): 10 * GiB}
    assert simulated.free(4 * GiB) == 4 * GiB
    assert simulated.memory_allocated() == 6 * GiB


def test_processes_racing_for_memory_never_overcommit_a_gpu(sim):
    gpu = sim.devices[0].uuid
    script = _kernel_script(
        """
        try:
            simulated.allocate("30GiB")
            print("got", flush=True)
        except simulated.SimulatedOutOfMemory:
            print("oom", flush=True)
        """
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, STATE_ENV: sim.state_path}
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, **pipes) for _ in range(5)]
    try:
        outcomes = sorted(proc.stdout.readline().strip() for proc in procs)
        assert outcomes == ["got", "got", "oom", "oom", "oom"]  # 80 GiB holds two 30 GiB allocations
        assert _by_uuid(sim.snapshot())[gpu].memory_used == 60 * GiB
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=10)


@pytest.mark.parametrize("visible", [None, "", "-1"])
def test_no_visible_device_is_a_clear_error(sim, monkeypatch, visible):
    monkeypatch.setenv(STATE_ENV, sim.state_path)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(SimulatedCudaError, match="no CUDA device.*%gpu acquire"):
        simulated.allocate("1GiB")


def test_a_kernel_sees_only_its_devices_and_never_a_mig_parent(sim, kernel_env, monkeypatch):
    parent = next(d for d in sim.devices if any(c.parent_uuid == d.uuid for c in sim.devices))
    instance = next(d for d in sim.devices if d.parent_uuid == parent.uuid)
    with pytest.raises(SimulatedCudaError, match="not visible"):
        simulated.allocate("1GiB", device=sim.devices[1].uuid)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{parent.uuid},{instance.uuid}")
    with pytest.raises(SimulatedCudaError, match="MIG mode"):
        simulated.allocate("1GiB")
    assert simulated.allocate("15GiB", device=1) == instance.uuid
    with pytest.raises(SimulatedOutOfMemory):
        simulated.allocate("6GiB", device=1)  # a 3g.20gb instance has 20 GiB
    snapshot = _by_uuid(sim.snapshot())
    assert snapshot[instance.uuid].memory_used == 15 * GiB
    assert snapshot[parent.uuid].memory_used == 15 * GiB and snapshot[parent.uuid].processes == ()


def test_allocating_on_a_lost_gpu_fails(sim, kernel_env):
    sim.lose(sim.devices[0].uuid)
    with pytest.raises(DeviceLost) as excinfo:
        simulated.allocate("1GiB")
    assert excinfo.value.uuid == sim.devices[0].uuid


def test_checkpoint_and_restore_round_trip(sim):
    pid = os.getpid()
    gpu0, gpu1 = sim.devices[0].uuid, sim.devices[1].uuid
    sim.add_process(gpu0, pid, "24GiB", utilization=10)
    assert sim.checkpoint_support() == (True, "simulated GPUs support checkpoint")

    assert sim.checkpoint(pid) == 24 * GiB
    device = _by_uuid(sim.snapshot())[gpu0]
    assert device.processes == () and device.memory_used == 0
    assert sim.checkpointed(pid) == 24 * GiB

    assert sim.restore(pid) == 24 * GiB
    assert [(p.pid, p.memory_used) for p in _by_uuid(sim.snapshot())[gpu0].processes] == [(pid, 24 * GiB)]
    assert sim.checkpointed(pid) == 0

    sim.checkpoint(pid)
    assert sim.restore(pid, {gpu0: gpu1}) == 24 * GiB
    snapshot = _by_uuid(sim.snapshot())
    assert snapshot[gpu0].processes == ()
    assert [(p.pid, p.memory_used, p.utilization) for p in snapshot[gpu1].processes] == [(pid, 24 * GiB, 10.0)]
    assert sim.restore(pid) == 0  # nothing left on the host


def test_restore_is_all_or_nothing_and_keeps_to_one_model(sim, kernel_env):
    pid = os.getpid()
    gpu0, gpu1, other_model = sim.devices[0].uuid, sim.devices[1].uuid, sim.devices[3].uuid
    sim.add_process(gpu0, pid, "50GiB")
    sim.checkpoint(pid)
    with pytest.raises(SimulatedCudaError, match="checkpointed"):
        simulated.allocate("1GiB")  # a checkpointed process cannot touch the GPU

    with pytest.raises(ValueError, match="same GPU model"):
        sim.restore(pid, {gpu0: other_model})
    sim.add_process(gpu1, os.getppid(), "40GiB")
    with pytest.raises(SimulatedOutOfMemory):
        sim.restore(pid, {gpu0: gpu1})
    assert sim.checkpointed(pid) == 50 * GiB  # still safe on the host
    assert sim.restore(pid) == 50 * GiB


def test_device_utilization_is_scripted_or_the_sum_of_its_processes(sim):
    gpu = sim.devices[0].uuid
    sim.add_process(gpu, os.getpid(), "1GiB", utilization=70)
    sim.add_process(gpu, os.getppid(), "1GiB", utilization=60)
    assert _by_uuid(sim.snapshot())[gpu].utilization == 100.0
    sim.set_utilization(gpu, 15)
    assert _by_uuid(sim.snapshot())[gpu].utilization == 15.0
    sim.set_utilization(gpu, None)
    sim.set_process(gpu, os.getppid(), utilization=0)
    assert _by_uuid(sim.snapshot())[gpu].utilization == 70.0
    sim.remove_process(os.getpid())
    assert [p.pid for p in _by_uuid(sim.snapshot())[gpu].processes] == [os.getppid()]


def test_test_controls_refuse_what_a_gpu_could_not_do(sim):
    gpu = sim.devices[0].uuid
    dead = psutil.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(ValueError, match="not running"):
        sim.add_process(gpu, dead.pid, "1GiB")
    with pytest.raises(SimulatedOutOfMemory):
        sim.add_process(gpu, os.getpid(), "81GiB")
    with pytest.raises(ValueError, match="one of"):
        sim.unsupported("colour")
    with pytest.raises(ValueError, match="not one of this backend"):
        sim.lose("GPU-nope")


def test_uuids_depend_only_on_the_seed_and_index(tmp_path):
    a = SimulatedBackend(3, state_path=str(tmp_path / "a.sqlite"))
    b = SimulatedBackend(3, state_path=str(tmp_path / "b.sqlite"))
    c = SimulatedBackend(3, state_path=str(tmp_path / "c.sqlite"), seed="other host")
    assert [d.uuid for d in a.snapshot()] == [d.uuid for d in b.snapshot()]
    assert not {d.uuid for d in a.snapshot()} & {d.uuid for d in c.snapshot()}
    default = a.snapshot()[0]
    # A simulated GPU says so, and keeps the model that architecture and restores go by.
    assert (default.name, default.memory_total, default.architecture) == ("Simulated H100 80GB", 80 * GiB, "Hopper")


def test_default_simulated_gpus_and_their_mig_instances_say_they_are_simulated():
    devices = parse_devices([{}, {"mig": ["3g.40gb"]}])
    assert [d.name for d in devices] == ["Simulated H100 80GB", "Simulated H100 80GB", "Simulated H100 80GB MIG 3g.40gb"]
    assert {d.architecture for d in devices} == {"Hopper"}
    assert not any(d.name.startswith("NVIDIA") for d in devices)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([{"name": "A100", "mig": ["3g.40gb", "4g.40gb", "1g.10gb"]}], "compute slices"),
        ([{"memory": "40GiB", "mig": ["4g.40gb", "3g.40gb"]}], "more than the GPU"),
        ([{"mig": ["big"]}], "MIG profile such as"),
        ([{"memroy": "80GiB"}], "unknown keys"),
        ([{"memory": "lots"}], "memory must be a size"),
        ("two", "number of GPUs"),
        (-1, "0 or more"),
    ],
)
def test_bad_configuration_says_what_is_wrong(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        SimulatedBackend(config, state_path=str(tmp_path / "s.sqlite"))


def test_open_backend_by_name(tmp_path):
    backend = open_backend("simulated", simulated_devices=2, state_path=str(tmp_path / "s.sqlite"))
    assert backend.name == "simulated" and len(backend.snapshot()) == 2
    with pytest.raises(ValueError, match="auto, nvml, simulated"):
        open_backend("cuda")


# -- NVML without a GPU ------------------------------------------------------------------------


def test_auto_without_a_gpu_raises_a_helpful_error_and_never_simulates():
    try:
        backend = open_backend("auto")
    except InventoryUnavailable as exc:
        message = str(exc)
        assert "NVIDIA" in message or "NVML" in message
        assert "backend = 'simulated'" in message
    else:
        backend.close()
        assert backend.name == "nvml"  # a host with a GPU: auto found it


def test_importing_the_nvml_backend_makes_no_nvml_call():
    # A fresh interpreter, so that nothing else has imported or initialized pynvml before.
    script = textwrap.dedent(
        """
        import sys
        import pynvml
        calls = []
        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_filename == pynvml.__file__:
                calls.append(frame.f_code.co_name)
        sys.setprofile(tracer)
        import jupyter_gpusched.devices.nvml as nvml
        backend = nvml.NvmlBackend()
        sys.setprofile(None)
        assert pynvml.nvmlLib is None, "the NVML library was loaded"
        print(sorted(set(calls)))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    called = eval(result.stdout.strip())  # noqa: S307 - our own output, a list of names
    assert not [name for name in called if name.startswith(("nvml", "_nvml", "_Load"))]


# -- NVML on a real GPU ------------------------------------------------------------------------


@pytest.mark.gpu
def test_nvml_snapshot_sees_every_gpu_nvidia_smi_would():
    backend = _open_nvml()
    try:
        snapshot = backend.snapshot()
        physical = [d for d in snapshot if d.parent_uuid is None]
        assert [d.index for d in physical] == list(range(backend.device_count()))
        assert all(d.health == "ok" for d in snapshot)
        assert all(d.memory_used is not None for d in physical)
    finally:
        backend.close()
    assert backend.snapshot()  # opens NVML again after close
    backend.close()
