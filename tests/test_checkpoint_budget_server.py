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
    assert "a checkpoint of 2.0 GiB would go over checkpoint_host_memory (1.0 GiB of it left)" in other["reason"]
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
        "checkpoint not taken: a checkpoint of 4.0 GiB would go over checkpoint_host_memory (3.0 GiB of it left)"
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
