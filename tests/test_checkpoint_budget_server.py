"""``checkpoint_host_memory`` in a real server with real kernels on simulated GPUs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from traitlets import TraitError

from conftest import api
from jupyter_gpusched.config import SchedulingConfig, host_memory_budget
from jupyter_gpusched.core import LeaseState, Step
from test_e2e_kernels import _lease_of, _state_is, _until

GiB = 1024**3


@pytest.fixture
def sched_config(sched_config):
    sched_config["checkpoint_host_memory"] = "3GiB"
    return sched_config


async def test_a_second_checkpoint_over_the_budget_is_not_taken_and_the_reason_says_so(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    k2 = await start_kernel("gpu")
    for k in (k1, k2):
        out = await k.execute("from jupyter_gpusched.devices import simulated; simulated.allocate('2GiB')")
        assert out["error"] is None, out
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    assert status["checkpoint"]["available"] is True
    assert status["checkpoint"]["host_memory_budget"] == 3 * GiB
    assert status["checkpoint"]["host_memory_held"] == 0

    # A third kernel waits; both others are idle: one of them is checkpointed (2 GiB fit in 3).
    k3 = await start_kernel("gpu")
    code, _ = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k3.id})
    assert code == 202
    clock.advance(120)
    await arbiter.tick()

    async def one_suspended():
        states = [(await _lease_of(jp_fetch, k.id))["state"] for k in (k1, k2)]
        return states.count("suspended") == 1

    await _until(one_suspended, what="one kernel to be checkpointed")
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    assert status["checkpoint"]["host_memory_held"] == 2 * GiB
    assert (await _lease_of(jp_fetch, k3.id))["state"] == "active"

    # A fourth kernel waits: the other idle kernel's 2 GiB would take checkpoints to 4 GiB, over the
    # budget, so it is announced for a restart instead, and its reason says why.
    k4 = await start_kernel("gpu")
    code, _ = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k4.id})
    assert code == 202
    # Kernel 3 computes, so it is no candidate; the other idle kernel has been idle long enough.
    busy = asyncio.ensure_future(k3.execute("import time; time.sleep(3)", timeout=60))
    await asyncio.sleep(1.0)
    await arbiter.tick()
    leases = [await _lease_of(jp_fetch, k.id) for k in (k1, k2)]
    other = next(le for le in leases if le["state"] != "suspended")
    assert other["state"] == "reclaiming" and other["reclaim_step"] == "restart", other
    assert "a checkpoint of 2.0 GiB would not fit in the host memory left for checkpoints (1.0 GiB left of" in other["reason"]
    await busy


async def test_the_executor_does_not_take_a_checkpoint_that_grew_past_the_budget(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter
):
    """The pass decided on the memory it last saw; the executor checks what the kernel holds now."""
    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    out = await k.execute("from jupyter_gpusched.devices import simulated; simulated.allocate('4GiB')")
    assert out["error"] is None, out
    await arbiter.tick()
    lease = arbiter.live_lease((await _lease_of(jp_fetch, k.id))["id"])

    def due_for_checkpoint(cur, now):
        return replace(
            cur, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT, reclaim_at=now, memory_held=GiB,
            reason="idle while someone waits; the kernel's GPU state can be checkpointed to host memory",
        )

    reclaiming = await arbiter.update(lease, due_for_checkpoint)
    arbiter.reclaims.carry_out_due([reclaiming])
    await _until(lambda: _state_is(jp_fetch, lease.id, "idle"), what="the checkpoint to be turned down")
    got = (await api(jp_fetch, "leases", lease.id))[1]
    assert got["reason"] == (
        "checkpoint not taken: a checkpoint of 4.0 GiB would not fit in the host memory left for checkpoints "
        "(3.0 GiB left of what the checkpoint_host_memory setting allows)"
    )
    assert Step.CHECKPOINT in arbiter.live_lease(lease.id).tried_steps
    out = await k.execute("print(simulated.memory_allocated())")
    assert out["stdout"].strip() == str(4 * GiB), "the kernel's GPU memory was left alone"
    assert arbiter.ledger.checkpoints() == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [("50%", 8 * GiB), ("256GiB", 256 * GiB), (10**12, 10**12), ("unlimited", None), (0, 0), ("0%", 0)],
)
def test_the_budget_is_bytes_a_size_a_share_of_ram_or_unlimited(value, expected):
    assert host_memory_budget(value, total=16 * GiB) == expected


@pytest.mark.parametrize("value", ["lots", "150%", "-1GiB", -5, "", "x%"])
def test_a_bad_budget_is_refused_with_a_message_that_says_what_is_allowed(value):
    with pytest.raises(TraitError, match="checkpoint_host_memory must be|between 0% and 100%"):
        SchedulingConfig(checkpoint_host_memory=value)


def test_the_default_budget_is_half_of_the_hosts_ram():
    import psutil

    cfg = SchedulingConfig().sched_config()
    assert cfg.checkpoint_host_memory == psutil.virtual_memory().total // 2


# -- the kernel's own memory limit (its cgroup; a pod's limit on Kubernetes) --------------------


def _cgroup_tree(tmp_path, pid, lines_limit, usage=0, v1=None):
    """A cgroup file system under ``tmp_path`` with ``pid``'s own cgroup path limited to ``lines_limit``."""
    with open(f"/proc/{pid}/cgroup") as f:
        lines = f.read().splitlines()
    memory_line = next((ln for ln in lines if "memory" in ln.split(":")[1].split(",")), None)
    if memory_line is not None:
        path = memory_line.split(":", 2)[2]
        folder = tmp_path / "memory" / path.strip("/")
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    else:
        path = next(ln for ln in lines if ln.startswith("0::")).split(":", 2)[2]
        folder = tmp_path / path.strip("/")
        files = ("memory.max", "memory.current")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / files[0]).write_text(f"{lines_limit}\n")
    (folder / files[1]).write_text(f"{usage}\n")
    return tmp_path


def test_memory_room_reads_cgroup_v1_and_v2_and_takes_the_tightest_ancestor(tmp_path):
    from jupyter_gpusched import cgroups

    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/kubepods/pod1/ctr\n")
    v2 = tmp_path / "v2"
    for folder, limit, used in (("kubepods/pod1", 8 * GiB, 6 * GiB), ("kubepods/pod1/ctr", "max", 5 * GiB)):
        (v2 / folder).mkdir(parents=True)
        (v2 / folder / "memory.max").write_text(f"{limit}\n")
        (v2 / folder / "memory.current").write_text(f"{used}\n")
    assert cgroups.memory_room(7, proc=str(proc), root=str(v2)) == 2 * GiB
    # The page cache the kernel can drop is not in use: 1 GiB of inactive file cache is room.
    (v2 / "kubepods/pod1" / "memory.stat").write_text(f"anon {5 * GiB}\ninactive_file {GiB}\nactive_file 0\n")
    assert cgroups.memory_room(7, proc=str(proc), root=str(v2)) == 3 * GiB

    (proc / "8").mkdir()
    (proc / "8" / "cgroup").write_text("4:memory:/lab/k\n3:cpu:/\n0::/\n")
    v1 = tmp_path / "v1"
    (v1 / "memory" / "lab" / "k").mkdir(parents=True)
    (v1 / "memory" / "lab" / "k" / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    (v1 / "memory" / "lab" / "k" / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    assert cgroups.memory_room(8, proc=str(proc), root=str(v1)) == 3 * GiB
    (v1 / "memory" / "lab" / "k" / "memory.stat").write_text(f"cache {GiB}\ntotal_inactive_file {GiB // 2}\n")
    assert cgroups.memory_room(8, proc=str(proc), root=str(v1)) == 3 * GiB + GiB // 2

    (v1 / "memory" / "lab" / "k" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroups.memory_room(8, proc=str(proc), root=str(v1)) is None
    assert cgroups.memory_room(9, proc=str(proc), root=str(v1)) is None  # no such process
    assert cgroups.memory_room(7, proc=str(proc), root=str(tmp_path / "nothing")) is None


async def test_a_checkpoint_that_the_kernels_memory_limit_cannot_hold_is_not_taken(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, tmp_path, monkeypatch
):
    """The checkpoint lands in the kernel process's own memory: over its cgroup's limit, the kernel
    would be killed. It is not taken; the kernel and its GPU memory are left alone."""
    from jupyter_gpusched import cgroups

    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    out = await k.execute(
        "import os; from jupyter_gpusched.devices import simulated; simulated.allocate('4GiB'); print(os.getpid())"
    )
    assert out["error"] is None, out
    pid = int(out["stdout"].split()[-1])
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", str(_cgroup_tree(tmp_path / "cgroup", pid, 3 * GiB, usage=GiB)))
    monkeypatch.setattr(arbiter, "cfg", replace(arbiter.cfg, checkpoint_host_memory=None))  # only the cgroup
    await arbiter.tick()
    lease = arbiter.live_lease((await _lease_of(jp_fetch, k.id))["id"])

    def due_for_checkpoint(cur, now):
        return replace(cur, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT, reclaim_at=now)

    arbiter.reclaims.carry_out_due([await arbiter.update(lease, due_for_checkpoint)])
    await _until(lambda: _state_is(jp_fetch, lease.id, "idle"), what="the checkpoint to be turned down")
    got = (await api(jp_fetch, "leases", lease.id))[1]
    assert got["reason"] == (
        f"checkpoint not taken: process {pid}'s 4.0 GiB of GPU memory would not fit in the 2.0 GiB "
        "its memory limit (cgroup) leaves it"
    )
    out = await k.execute("print(simulated.memory_allocated())")
    assert out["stdout"].strip() == str(4 * GiB)
