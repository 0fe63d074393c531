"""A checkpoint whose lock times out (real kernels on simulated GPUs, a real server).

The driver's lock waits for the kernel's GPU work in flight, up to a timeout. When the work
outlasts it, nothing is checkpointed: the lease stays active with a reason that says so, the
kernel is unharmed, and the checkpoint is tried again later (not at the next pass), when it can
succeed. The simulated GPUs model work in flight with ``simulated.launch``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from conftest import api
from jupyter_gpusched.core import LeaseState, Step
from test_e2e_kernels import _lease_of, _state_is, _until

pytestmark = pytest.mark.slow

GiB = 1024**3
#: A lock timeout short enough for a test (the server's default is 30 s).
LOCK_MS = 300
WORK_S = 3.0
DID_NOT_PAUSE = f"the kernel's GPU work did not pause within {LOCK_MS} ms (the checkpoint lock timed out)"


@pytest.fixture
def sched_config(sched_config):
    sched_config.update(simulated_devices=1, policy="dynamic", idle_timeout=60.0, contended_idle_timeout=60.0)
    return sched_config


async def _kernel_with_memory(jp_fetch, gpu_kernelspec, start_kernel, arbiter):
    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    out = await k.execute("from jupyter_gpusched.devices import simulated; simulated.allocate('2GiB')")
    assert out["error"] is None, out
    await arbiter.tick()
    return k, await _lease_of(jp_fetch, k.id)


async def _launch_work(k, arbiter) -> float:
    """The cell ends at once; its GPU work runs on for ``WORK_S`` (an asynchronous launch).
    Returns when (``time.monotonic``) the work is done."""
    out = await k.execute(f"simulated.launch({WORK_S})")
    assert out["error"] is None, out
    done = time.monotonic() + WORK_S
    await _until(lambda: _seen_idle(arbiter, k.id), what="the end of the cell to be seen")
    return done


async def _seen_idle(arbiter, kernel_id: str) -> bool:
    arbiter.kernels.activity()
    return not arbiter.kernels.executing(kernel_id)


async def _timed_out(jp_fetch, lease_id: str) -> bool:
    """The lease is active again and says its lock timed out."""
    code, lease = await api(jp_fetch, "leases", lease_id)
    return code == 200 and lease["state"] == "active" and DID_NOT_PAUSE in lease["reason"]


async def test_a_lock_that_times_out_leaves_the_lease_active_and_the_kernel_unharmed(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    arbiter.checkpointer.lock_timeout_ms = LOCK_MS
    k, lease = await _kernel_with_memory(jp_fetch, gpu_kernelspec, start_kernel, arbiter)
    work_done = await _launch_work(k, arbiter)

    def due(cur, now):
        return replace(cur, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT, reclaim_at=now, reason="idle")

    arbiter.reclaims.carry_out_due([await arbiter.update(arbiter.live_lease(lease["id"]), due)])
    await _until(lambda: _timed_out(jp_fetch, lease["id"]), what="the lock to time out")
    got = (await api(jp_fetch, "leases", lease["id"]))[1]
    assert got["devices"] == lease["devices"] and got["reclaim_step"] is None, got
    assert DID_NOT_PAUSE in got["reason"], got
    stored = arbiter.ledger.lease(lease["id"])
    assert Step.CHECKPOINT not in stored.tried_steps, "the ladder did not go on to a disruptive step"
    assert arbiter.ledger.checkpoints() == []
    assert not arbiter.reclaims.busy(lease["id"])

    # The kernel is unharmed: its memory stayed on its GPU and its cells run.
    out = await k.execute("print(simulated.memory_allocated())")
    assert out["error"] is None and out["stdout"].strip() == str(2 * GiB), out
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    assert {d["uuid"]: d["memory_used"] for d in status["devices"]}[lease["devices"][0]] == 2 * GiB

    # Once the work is done, the same checkpoint succeeds.
    await asyncio.sleep(max(0.0, work_done - time.monotonic()))
    arbiter.reclaims.carry_out_due([await arbiter.update(arbiter.live_lease(lease["id"]), due)])
    await _until(lambda: _state_is(jp_fetch, lease["id"], "suspended"), what="the checkpoint once the work is done")


async def test_a_kernel_whose_gpu_work_outlasts_the_lock_keeps_its_gpu_and_is_checkpointed_later(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    """Through the scheduler: a waiting claim makes the idle kernel due for a checkpoint; the
    lock times out; the next passes leave the lease alone; once it has been idle long enough
    again the checkpoint is tried again and succeeds, and the waiting kernel gets the GPU."""
    clock = use_clock
    arbiter.checkpointer.lock_timeout_ms = LOCK_MS
    notices: list[dict] = []
    arbiter.subscribe(lambda e: notices.append(dict(e.notice)) if e.type == "notice" and e.notice else None)
    k, lease = await _kernel_with_memory(jp_fetch, gpu_kernelspec, start_kernel, arbiter)
    k2 = await start_kernel("gpu")
    code, pending = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2.id})
    assert code == 202, pending
    work_done = await _launch_work(k, arbiter)

    clock.advance(120)
    await arbiter.tick()
    await _until(lambda: _timed_out(jp_fetch, lease["id"]), what="the lock to time out")
    got = (await api(jp_fetch, "leases", lease["id"]))[1]
    assert DID_NOT_PAUSE in got["reason"] and got["devices"] == lease["devices"], got
    assert not [n for n in notices if n["kind"] in ("suspended", "reclaimed", "reclaim_warning")], notices

    # Not tried again at once: the next passes leave it active, and the claim waits.
    for _ in range(3):
        clock.advance(5)
        await arbiter.tick()
        await asyncio.sleep(0.1)
        assert (await api(jp_fetch, "leases", lease["id"]))[1]["state"] == "active"
        assert (await api(jp_fetch, "leases", pending["id"]))[1]["state"] == "pending"
    out = await k.execute("print(simulated.memory_allocated())")
    assert out["error"] is None and out["stdout"].strip() == str(2 * GiB), out

    # Later, with the work done, the checkpoint is tried again and the waiting kernel is served.
    await asyncio.sleep(max(0.0, work_done - time.monotonic()))
    clock.advance(120)
    await arbiter.tick()
    await _until(lambda: _state_is(jp_fetch, lease["id"], "suspended"), what="the second checkpoint")
    await arbiter.tick()
    await _until(lambda: _state_is(jp_fetch, pending["id"], "active"), what="the waiting kernel to get the GPU")
