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



async def test_a_cell_that_asks_for_a_gpu_before_the_server_watched_the_kernel_counts_as_running(
    gpu_kernelspec, start_kernel, jp_serverapp
):
    """A lazily bound kernel's first cell claims its GPU while it runs: a watch on the kernel
    that begins during that cell must still see it running, until the kernel is idle again."""
    from jupyter_gpusched.server.kernels import ServerKernels

    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    cell = asyncio.ensure_future(k.execute("import time; time.sleep(3)", timeout=60))
    km = jp_serverapp.kernel_manager
    await _until(lambda: _busy(km, k.id), what="jupyter_server to see the kernel busy")
    late = ServerKernels(km)  # a watch that begins now, mid-cell
    assert late.activity()[k.id][0] is False, "a watch that began mid-cell did not see the cell begin"
    late.asking(k.id)  # what the kernel's claim tells the host
    assert late.executing(k.id)
    assert late.activity()[k.id][0] is True
    await cell
    await _until(lambda: _not_executing(late, k.id), what="the end of the cell to be seen")
    executing, last, started = late.activity()[k.id]
    assert executing is False and last is not None and started is not None and last >= started


async def test_an_idle_kernel_that_asks_is_not_counted_as_running(gpu_kernelspec, start_kernel, jp_serverapp):
    from jupyter_gpusched.server.kernels import ServerKernels

    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    km = jp_serverapp.kernel_manager
    await _until(lambda: _idle(km, k.id), what="the kernel to be idle")
    late = ServerKernels(km)
    late.asking(k.id)
    assert not late.executing(k.id)
    assert late.activity()[k.id] == (False, None, None)


async def test_a_lazily_bound_kernels_first_cell_is_running_while_it_holds_its_new_gpu(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter
):
    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    cell = asyncio.ensure_future(
        k.execute("from jupyter_gpusched.devices import simulated; simulated.allocate('1GiB'); import time; time.sleep(4)", timeout=60)
    )
    await _until(lambda: _has_lease(jp_fetch, k.id), what="the first cell to claim a GPU")
    assert arbiter.kernels.executing(k.id), "the first cell runs"
    lease = await _lease_of(jp_fetch, k.id)
    assert lease["state"] == "active", lease
    out = await cell
    assert out["error"] is None, out
    await _until(lambda: _not_executing(arbiter.kernels, k.id), what="the end of the first cell to be seen")


async def _busy(km, kernel_id):
    return km.get_kernel(kernel_id).execution_state == "busy"


async def _idle(km, kernel_id):
    return km.get_kernel(kernel_id).execution_state == "idle"


async def _not_executing(kernels, kernel_id):
    return not kernels.executing(kernel_id)


async def _has_lease(jp_fetch, kernel_id):
    code, leases = await api(jp_fetch, "leases", params={"kernel_id": kernel_id})
    return code == 200 and any(le["state"] == "active" for le in leases)


async def test_a_checkpoint_that_lands_mid_cell_is_restored_as_soon_as_the_cell_needs_its_gpu(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, monkeypatch
):
    """On a hub broker the executor cannot tell that a cell runs (a server's word is not proof),
    so a checkpoint can land mid-cell. The cell's next GPU call asks for the lease back and waits
    for the restore: the cell neither fails nor hangs, and its GPU memory comes back with it."""
    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    out = await k.execute("from jupyter_gpusched.devices import simulated; simulated.allocate('1GiB')")
    assert out["error"] is None, out
    await arbiter.tick()
    lease_id = (await _lease_of(jp_fetch, k.id))["id"]
    # Nor does the server restore the running kernel on its own here: the kernel asks.
    monkeypatch.setattr(arbiter, "_resume_running", lambda tx, leases, activity, now: leases)
    told: list[str] = []
    arbiter.subscribe(lambda e: told.append(e.notice["kind"]) if e.type == "notice" and e.notice else None)

    cell = asyncio.ensure_future(k.execute(
        "import time\n"
        "for _ in range(40):\n"
        "    simulated.set_utilization(90); time.sleep(0.05)\n"
        "print(simulated.memory_allocated())",
        timeout=60,
    ))
    await _until(lambda: _executing(arbiter, k.id), what="the kernel to be seen running the cell")
    monkeypatch.setattr(arbiter.kernels, "executing", lambda kernel_id: False)
    await _due_for_checkpoint(arbiter, lease_id)
    out = await cell
    assert out["error"] is None and out["stdout"].strip().splitlines()[-1] == str(GiB), out
    assert "suspended" in told and "resumed" in told, told
    assert any("Restored this kernel's GPU state" in d for d in out["display"]), out
    lease = await _lease_of(jp_fetch, k.id)
    assert lease["id"] == lease_id and lease["state"] in ("active", "idle"), lease
    assert arbiter.ledger.checkpoints() == []

