"""A checkpoint that a cell has overtaken is called off (real kernels on simulated GPUs).

The pass decides on the kernel as it last saw it; by the time the executor would take the
checkpoint, the user may have started a cell, whose CUDA calls must not meet a checkpointed
process. The executor asks the kernel host once more and calls the checkpoint off.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from conftest import api
from jupyter_gpusched.core import LeaseState, Step
from test_e2e_kernels import _lease_of, _state_is, _until

GiB = 1024**3


async def _due_for_checkpoint(arbiter, lease_id):
    lease = arbiter.live_lease(lease_id)

    def due(cur, now):
        return replace(
            cur, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT, reclaim_at=now,
            reason="idle while someone waits; the kernel's GPU state can be checkpointed to host memory",
        )

    arbiter.reclaims.carry_out_due([await arbiter.update(lease, due)])


async def test_a_checkpoint_overtaken_by_a_cell_is_called_off(jp_fetch, gpu_kernelspec, start_kernel, arbiter):
    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    out = await k.execute("from jupyter_gpusched.devices import simulated; simulated.allocate('2GiB')")
    assert out["error"] is None, out
    await arbiter.tick()
    lease_id = (await _lease_of(jp_fetch, k.id))["id"]

    # The user starts a cell; the server sees the kernel busy (IOPub) before the executor acts.
    cell = asyncio.ensure_future(k.execute("import time; time.sleep(4); print(simulated.memory_allocated())", timeout=60))
    await _until(lambda: _executing(arbiter, k.id), what="the kernel to be seen running the cell")
    await _due_for_checkpoint(arbiter, lease_id)
    await _until(lambda: _state_is(jp_fetch, lease_id, "active"), what="the checkpoint to be called off")
    got = (await api(jp_fetch, "leases", lease_id))[1]
    assert got["reason"] == "checkpoint called off: the kernel is running a cell"
    assert arbiter.ledger.checkpoints() == []
    out = await cell
    assert out["error"] is None and out["stdout"].strip() == str(2 * GiB), out

    # Idle again, the same checkpoint is taken.
    await _due_for_checkpoint(arbiter, lease_id)
    await _until(lambda: _state_is(jp_fetch, lease_id, "suspended"), what="the checkpoint of the idle kernel")


async def _executing(arbiter, kernel_id):
    arbiter.kernels.activity()  # the watch on the kernel's IOPub starts with the arbiter's first look
    return arbiter.kernels.executing(kernel_id)

