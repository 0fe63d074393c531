"""MIG instances cannot be checkpointed: real kernels on simulated MIG instances, a real server.

An idle kernel on a MIG instance is never checkpointed: its idle forecast says so ahead, and when
another kernel waits the ladder announces the next step instead. A checkpoint that reaches the
simulated driver anyway is refused as the driver refuses it, and the refusal is handled: the
kernel keeps its GPU and its memory, and no pass tries the checkpoint on that GPU again.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from conftest import api
from jupyter_gpusched.core import LeaseState, Step
from jupyter_gpusched.core.ladder import MIG_REFUSED
from test_e2e_kernels import _lease_of, _state_is, _until

pytestmark = pytest.mark.slow

GiB = 1024**3
ALLOCATE = "from jupyter_gpusched.devices import simulated; simulated.allocate('2GiB')"


@pytest.fixture
def sched_config(sched_config):
    sched_config.update(
        simulated_devices=[{"name": "NVIDIA A100-SXM4-80GB", "memory": "80GiB", "mig": ["3g.40gb", "3g.40gb"]}],
        policy="dynamic",
        idle_timeout=60.0,
        contended_idle_timeout=60.0,
        grace_period=30.0,
    )
    return sched_config


def _checkpoints_tried(arbiter, monkeypatch) -> list[int]:
    """Every pid the server asks the checkpointer to checkpoint."""
    tried: list[int] = []
    real = arbiter.checkpointer.checkpoint

    def checkpoint(pid):
        tried.append(pid)
        return real(pid)

    monkeypatch.setattr(arbiter.checkpointer, "checkpoint", checkpoint)
    return tried


async def test_an_idle_kernel_on_a_mig_instance_is_never_checkpointed_and_its_forecast_said_so(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock, monkeypatch, jp_serverapp
):
    clock = use_clock
    tried = _checkpoints_tried(arbiter, monkeypatch)
    assert arbiter.caps.checkpoint, "the simulated driver checkpoints whole GPUs"
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    k2 = await start_kernel("gpu")
    for k in (k1, k2):
        out = await k.execute(ALLOCATE)
        assert out["error"] is None, out
    await arbiter.tick()
    lease1 = await _lease_of(jp_fetch, k1.id)
    _, status = await api(jp_fetch, "status")
    device = next(d for d in status["devices"] if d["uuid"] == lease1["devices"][0])
    assert device["parent_uuid"] is not None, "the kernel runs on a MIG instance"

    # Beforehand, the lease says what idle will do: not a checkpoint, and why.
    forecast = lease1["idle_forecast"]
    assert forecast["step"] == "restart", forecast
    assert forecast["reason"].startswith(f"{MIG_REFUSED}: GPU {device['index']}"), forecast
    assert "restarted (its variables are lost)" in forecast["reason"]

    # A third kernel waits; kernel 2 computes, kernel 1 stays idle past its timeout.
    k3 = await start_kernel("gpu")
    code, pending = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k3.id})
    assert code == 202, pending
    busy = asyncio.ensure_future(k2.execute("import time; time.sleep(3)", timeout=60))
    await asyncio.sleep(0.5)
    clock.advance(120)
    await arbiter.tick()
    got = (await api(jp_fetch, "leases", lease1["id"]))[1]
    assert got["state"] == "reclaiming" and got["reclaim_step"] == "restart", got
    assert MIG_REFUSED in got["reason"], got
    await busy

    # The announced restart is carried out; nothing was ever checkpointed.
    clock.advance(31)
    await arbiter.tick()
    await _until(lambda: _state_is(jp_fetch, lease1["id"], "released"), what="the announced restart")
    # Kernel 3 gets the instance once the old kernel process's memory is gone from it (memory
    # outside any lease counts as taken).

    async def granted():
        await arbiter.tick()
        return (await _lease_of(jp_fetch, k3.id))["state"] == "active"

    await _until(granted, what="kernel 3 to get the GPU")
    assert tried == [] and arbiter.ledger.checkpoints() == []
    # The restarted kernel comes back (and the server can shut it down cleanly).
    km = jp_serverapp.kernel_manager

    async def restarted():
        ready = km.get_kernel(k1.id).ready
        return ready.done()

    await _until(restarted, what="kernel 1 to be back after its restart")


async def test_a_mig_checkpoint_refused_by_the_driver_leaves_the_kernel_its_gpu_and_is_not_tried_again(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    out = await k.execute(ALLOCATE)
    assert out["error"] is None, out
    await arbiter.tick()
    lease = await _lease_of(jp_fetch, k.id)
    uuid = lease["devices"][0]

    # The step reaches the executor anyway (a plan made before the host's MIG layout was known).
    def due(cur, now):
        return replace(
            cur, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT, reclaim_at=now, reason="idle while someone waits",
        )

    arbiter.reclaims.carry_out_due([await arbiter.update(arbiter.live_lease(lease["id"]), due)])
    await _until(lambda: _state_is(jp_fetch, lease["id"], "idle"), what="the refusal to be handled")
    got = (await api(jp_fetch, "leases", lease["id"]))[1]
    assert got["devices"] == [uuid] and got["reclaim_step"] is None
    assert got["reason"].startswith(f"checkpoint not taken: {MIG_REFUSED}"), got
    assert arbiter.ledger.checkpoints() == []
    assert uuid in arbiter.caps.no_checkpoint

    # The kernel is unharmed: its memory is where it was.
    out = await k.execute("print(simulated.memory_allocated())")
    assert out["error"] is None and out["stdout"].strip() == str(2 * GiB), out

    # Its forecast no longer offers a checkpoint, and the next reclaim goes to the next step.
    clock.advance(1)
    await arbiter.tick()
    got = (await api(jp_fetch, "leases", lease["id"]))[1]
    assert got["idle_forecast"]["step"] == "restart" and MIG_REFUSED in got["idle_forecast"]["reason"], got
