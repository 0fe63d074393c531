"""Acceptance: a checkpointed kernel is restored only onto a GPU whose free memory holds its
checkpoint; until then its cell waits, and its lease says why. Memory used by processes outside any
lease (a kernel that gave its lease back and kept its memory, a job started outside Jupyter) counts.

A real jupyter_server with the extension on one simulated 80 GiB GPU (dynamic policy, no limit on
checkpoint host memory) and real ipykernel kernels. The server's clock is a fake one that the test
moves; the kernels run their cells for real.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from conftest import api
from jupyter_gpusched.core import LeaseState, Step
from test_e2e_kernels import _lease_of, _state_is, _until

pytestmark = pytest.mark.slow

GiB = 1024**3
SIM = "from jupyter_gpusched.devices import simulated\n"


@pytest.fixture
def sched_config(sched_config):
    sched_config.update(
        simulated_devices=[{"name": "H100", "memory": "80GiB"}],
        policy="dynamic",
        checkpoint_host_memory="unlimited",
        idle_timeout=60.0,
        contended_idle_timeout=60.0,
    )
    return sched_config


def _said(out: dict) -> str:
    return out["stdout"] + " ".join(out["display"]) + str(out["error"] or "")


async def _reason(jp_fetch, kernel_id: str) -> str:
    return (await _lease_of(jp_fetch, kernel_id))["reason"]


async def _checkpoint(arbiter, jp_fetch, kernel_id: str) -> str:
    """Take the kernel's GPU state to host memory now, as an idle reclaim would."""
    from dataclasses import replace

    lease = arbiter.live_lease((await _lease_of(jp_fetch, kernel_id))["id"])

    def due(cur, now):
        return replace(
            cur, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT, reclaim_at=now,
            reason="idle: its GPU state can be checkpointed to host memory",
        )

    arbiter.reclaims.carry_out_due([await arbiter.update(lease, due)])
    await _until(lambda: _state_is(jp_fetch, lease.id, "suspended"), what="the kernel to be checkpointed")
    return lease.id


def _no_task_lost(caplog) -> None:
    lost = [r for r in caplog.records if "exception was never retrieved" in r.getMessage()]
    assert not lost, lost


async def test_a_restore_waits_while_a_released_kernel_keeps_its_memory_and_runs_once_it_ends(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock, caplog
):
    caplog.set_level(logging.INFO)
    clock = use_clock
    gpu_kernelspec("gpu")
    a = await start_kernel("gpu")
    out = await a.execute(SIM + "simulated.allocate('60GiB')\nmarker = 'state kept'")
    assert out["error"] is None, out
    await arbiter.tick()
    lease_a = (await _lease_of(jp_fetch, a.id))["id"]

    # B's first cell queues; A has been idle long enough and is checkpointed; B gets the GPU.
    b = await start_kernel("gpu")
    b_cell = asyncio.ensure_future(b.execute(SIM + "simulated.allocate('30GiB')\nprint('B HOLDS')", timeout=120))

    async def b_waits():
        _, leases = await api(jp_fetch, "leases", params={"kernel_id": b.id})
        return [le for le in leases if le["state"] == "pending"]

    await _until(b_waits, what="B's first cell to queue")
    clock.advance(120)
    await arbiter.tick()
    await _until(lambda: _state_is(jp_fetch, lease_a, "suspended"), what="A to be checkpointed")
    out_b = await b_cell
    assert out_b["error"] is None and "B HOLDS" in out_b["stdout"], out_b

    # B gives its lease back but its process keeps its 30 GiB.
    out_b = await b.execute("%gpu release")
    assert out_b["error"] is None, out_b
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    assert status["devices"][0]["memory_used"] == 30 * GiB
    assert not [le for le in status["leases"] if le["state"] in ("active", "idle", "reclaiming")]

    # A's next cell waits: 50 GiB are free, too little for its 60 GiB checkpoint.
    resumed = asyncio.ensure_future(a.execute("print(marker, simulated.memory_allocated())", timeout=120))
    await _until(lambda: _state_is(jp_fetch, lease_a, "pending"), what="A to ask for its GPU back")
    for _ in range(3):
        clock.advance(5)
        await arbiter.tick()
        await asyncio.sleep(0.5)
    lease = await _lease_of(jp_fetch, a.id)
    assert lease["state"] == "pending", lease
    assert lease["reason"].startswith("waiting for room to restore: GPU 0 has 50.0 GiB free, too little for its 60.0 GiB"), lease
    assert not resumed.done(), "A's cell must wait for room, not run"
    assert arbiter.backend.checkpointed(arbiter.kernels.kernel_pid(a.id)) == 60 * GiB
    _, status = await api(jp_fetch, "status")
    queued = [q for q in status["queue"] if q["lease_id"] == lease_a]
    assert queued and "60.0 GiB" in queued[0]["reason"], status["queue"]

    # B's kernel ends, its memory with it: A's cell runs with its 60 GiB intact.
    b_pid = arbiter.kernels.kernel_pid(b.id)
    await jp_fetch("api", "kernels", b.id, method="DELETE")

    async def b_memory_gone() -> bool:
        # B's process is gone from the GPU (A's restore may already take the room it left).
        snap = await asyncio.to_thread(arbiter.backend.snapshot)
        return all(p.pid != b_pid for p in snap[0].processes)

    await _until(b_memory_gone, timeout=90, what="B's memory to go with its kernel")
    clock.advance(5)
    await arbiter.tick()
    out = await resumed
    assert out["error"] is None, out
    assert f"state kept {60 * GiB}" in out["stdout"], out
    assert "Restored this kernel's GPU state" in _said(out)
    assert (await _lease_of(jp_fetch, a.id))["state"] == "active"
    assert arbiter.ledger.checkpoints() == []
    _no_task_lost(caplog)


def _holder(arbiter, uuid: str, memory: str) -> subprocess.Popen:
    """A process outside Jupyter that holds ``memory`` on the simulated GPU ``uuid``."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    arbiter.backend.add_process(uuid, proc.pid, memory)
    return proc


async def test_a_restore_whose_gpu_lacks_room_waits_and_succeeds_when_room_appears(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock, caplog
):
    clock = use_clock
    gpu_kernelspec("gpu")
    a = await start_kernel("gpu")
    out = await a.execute(SIM + "simulated.allocate('60GiB')\nmarker = 'state kept'")
    assert out["error"] is None, out
    await arbiter.tick()
    lease_a = await _checkpoint(arbiter, jp_fetch, a.id)
    uuid = arbiter.state.snapshot[0].uuid
    job = _holder(arbiter, uuid, "25GiB")
    try:
        resumed = asyncio.ensure_future(a.execute("print(marker, simulated.memory_allocated())", timeout=120))
        await _until(lambda: _state_is(jp_fetch, lease_a, "pending"), what="A to ask for its GPU back")
        clock.advance(5)
        await arbiter.tick()
        reason = await _reason(jp_fetch, a.id)
        assert "waiting for room to restore: GPU 0 has 55.0 GiB free" in reason, reason
        assert "processes outside any lease use 25.0 GiB" in reason, reason
        await asyncio.sleep(1.0)
        assert not resumed.done()
    finally:
        job.kill()
        job.wait()
    clock.advance(5)
    await arbiter.tick()
    out = await resumed
    assert out["error"] is None, out
    assert f"state kept {60 * GiB}" in out["stdout"], out
    _no_task_lost(caplog)


async def test_a_restore_the_driver_finds_no_room_for_keeps_the_checkpoint_and_is_never_said_restored(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock, caplog
):
    """Where the driver does not report the memory in use, the server cannot see that the GPU
    lacks room: the restore runs out of memory as the driver's would, the process stays
    checkpointed, the cell waits, and it runs once there is room."""
    clock = use_clock
    gpu_kernelspec("gpu")
    a = await start_kernel("gpu")
    out = await a.execute(SIM + "simulated.allocate('60GiB')\nmarker = 'state kept'")
    assert out["error"] is None, out
    await arbiter.tick()
    lease_a = await _checkpoint(arbiter, jp_fetch, a.id)
    arbiter.backend.unsupported("memory_used")
    uuid = arbiter.state.snapshot[0].uuid
    job = _holder(arbiter, uuid, "30GiB")
    try:
        resumed = asyncio.ensure_future(a.execute("print(marker, simulated.memory_allocated())", timeout=120))
        await _until(lambda: _state_is(jp_fetch, lease_a, "pending"), what="A to ask for its GPU back")
        for _ in range(3):
            clock.advance(5)
            await arbiter.tick()
            await asyncio.sleep(0.5)
        lease = await _lease_of(jp_fetch, a.id)
        assert lease["state"] == "pending", lease
        assert lease["reason"].startswith("waiting for room to restore"), lease
        assert not resumed.done()
        pid = arbiter.kernels.kernel_pid(a.id)
        assert arbiter.backend.checkpointed(pid) == 60 * GiB, "the process stays checkpointed"
        assert arbiter.ledger.checkpoints(lease_a), "its checkpoint is kept"
    finally:
        job.kill()
        job.wait()
    clock.advance(5)
    await arbiter.tick()
    out = await resumed
    assert out["error"] is None, out
    assert f"state kept {60 * GiB}" in out["stdout"], out
    _no_task_lost(caplog)


async def test_an_orphaned_checkpoint_waits_for_room_and_is_restored_once_there_is(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock, caplog
):
    """A checkpoint whose lease was given back is restored onto its GPU only once the GPU's free
    memory holds it: until then its process stays checkpointed, its memory on the host."""
    clock = use_clock
    gpu_kernelspec("gpu")
    a = await start_kernel("gpu")
    out = await a.execute(SIM + "simulated.allocate('60GiB')")
    assert out["error"] is None, out
    await arbiter.tick()
    lease_a = await _checkpoint(arbiter, jp_fetch, a.id)
    pid = arbiter.kernels.kernel_pid(a.id)
    uuid = arbiter.state.snapshot[0].uuid
    job = _holder(arbiter, uuid, "30GiB")
    try:
        code, _ = await api(jp_fetch, "leases", lease_a, method="DELETE")
        assert code == 204
        for _ in range(3):
            clock.advance(5)
            await arbiter.tick()
        assert arbiter.backend.checkpointed(pid) == 60 * GiB, "restored into too little memory"
        assert arbiter.ledger.checkpoints()
    finally:
        job.kill()
        job.wait()
    clock.advance(5)
    await arbiter.tick()
    await arbiter.tick()
    assert arbiter.backend.checkpointed(pid) == 0
    assert arbiter.ledger.checkpoints() == []
    out = await a.execute("print(simulated.memory_allocated())")
    assert out["stdout"].strip() == str(60 * GiB), out
    _no_task_lost(caplog)
