"""The host memory budget for checkpoints (``checkpoint_host_memory``), in the core.

A checkpoint moves a kernel's GPU memory into host RAM. A checkpoint that would take the host's
checkpoints over the budget is not taken: the reclaim ladder goes on to its next step, and the
lease's reason says why.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from jupyter_gpusched.core import GiB, LeaseState, SchedConfig, SchedulingError, Step, request_resume, suspended
from jupyter_gpusched.core.forecast import forecast
from jupyter_gpusched.core.ladder import checkpoint_bytes, choose_step
from test_core_scheduler import CHECKPOINT, Host, gpus, idle_lease


def test_a_checkpoint_that_fits_the_budget_is_taken():
    step, _ = choose_step(idle_lease(memory_held=10 * GiB), SchedConfig(), CHECKPOINT, checkpoint_room=10 * GiB)
    assert step == Step.CHECKPOINT


def test_a_checkpoint_over_the_budget_goes_on_down_the_ladder_and_says_why():
    step, why = choose_step(idle_lease(memory_held=10 * GiB), SchedConfig(), CHECKPOINT, checkpoint_room=4 * GiB)
    assert step == Step.RESTART
    assert why == (
        "its GPU state cannot be kept (a restart is all that is left): a checkpoint of 10.0 GiB would not fit in "
        "the host memory left for checkpoints (4.0 GiB left of what the checkpoint_host_memory setting allows)"
    )
    step, why = choose_step(
        idle_lease(memory_held=10 * GiB), SchedConfig(reclaim_fallback="none"), CHECKPOINT, checkpoint_room=0
    )
    assert step is None and "would not fit in the host memory left for checkpoints" in why
    assert why.endswith("this server never restarts or shuts down a kernel to free a GPU (reclaim_fallback is 'none')")


def test_a_shared_lease_over_its_share_drops_its_caches_when_its_checkpoint_does_not_fit():
    over = replace(idle_lease(memory_held=20 * GiB), mode="shared", memory=10 * GiB)
    step, why = choose_step(over, SchedConfig(), CHECKPOINT, checkpoint_room=GiB)
    assert step == Step.FREE_CACHE
    assert why.startswith("a checkpoint of 20.0 GiB would not fit in the host memory left for checkpoints")


def test_checkpoints_held_are_suspended_leases_restores_waiting_and_checkpoints_being_written():
    lease = idle_lease(memory_held=3 * GiB)
    held = [
        suspended(lease, 10.0),  # 3 GiB in host memory
        request_resume(suspended(replace(lease, id="r"), 10.0), 20.0),  # waiting to be restored: still there
        replace(lease, id="w", state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT),  # being written
        replace(lease, id="i"),  # idle on its GPU: nothing in host memory
        replace(lease, id="x", state=LeaseState.RECLAIMING, reclaim_step=Step.RESTART),
    ]
    assert checkpoint_bytes(held) == 9 * GiB


def test_the_budget_must_not_be_negative():
    with pytest.raises(SchedulingError, match="checkpoint_host_memory must be 0 or more bytes"):
        SchedConfig(checkpoint_host_memory=-1)


def two_borrowed_leases(budget):
    """Alice holds three of three GPUs with a quota of one, 8 GiB each, all idle."""
    host = Host(gpus(3), caps=CHECKPOINT, quotas={"*": 1}, checkpoint_host_memory=budget, grace_period=60)
    for i, at in enumerate((0, 10, 20)):
        host.at(at).claim(f"a{i}", "alice")
        host.kernel(f"a{i}", memory=8 * GiB)
        host.tick(at)
    return host


def test_when_two_borrowed_leases_are_wanted_only_the_checkpoint_that_fits_is_taken():
    host = two_borrowed_leases(budget=12 * GiB)
    host.at(30).claim("b", "bob")
    host.claim("c", "carol")
    result = host.tick(200)
    steps = {lid: host[lid].reclaim_step for lid in ("a1", "a2") if host[lid].state != LeaseState.IDLE}
    kinds = sorted(d.kind for d in result.decisions if d.lease.id in ("a1", "a2"))
    # One checkpoint of 8 GiB fits in 12 GiB; the second would need 16 GiB: it gets notice of a restart.
    assert kinds == ["notice", "reclaim"]
    suspended_ids = [lid for lid in ("a1", "a2") if host[lid].state == LeaseState.SUSPENDED]
    assert len(suspended_ids) == 1
    other = ({"a1", "a2"} - set(suspended_ids)).pop()
    assert steps[other] == Step.RESTART
    assert "a checkpoint of 8.0 GiB would not fit in the host memory left for checkpoints (4.0 GiB left of" in host[other].reason


def test_without_a_budget_both_borrowed_leases_are_checkpointed():
    host = two_borrowed_leases(budget=None)
    host.at(30).claim("b", "bob")
    host.claim("c", "carol")
    host.tick(200)
    assert host["a1"].state == host["a2"].state == LeaseState.SUSPENDED


def test_a_restore_gives_its_share_of_the_budget_back():
    host = two_borrowed_leases(budget=8 * GiB)
    host.at(30).claim("b", "bob")
    host.tick(200)
    first = next(lid for lid in ("a1", "a2") if host[lid].state == LeaseState.SUSPENDED)
    assert checkpoint_bytes(host.leases.values()) == 8 * GiB
    # While its checkpoint waits in host memory, nothing else can be checkpointed.
    host.at(300).claim("c", "carol")
    host.tick(400, carry_out=False)
    other = ({"a1", "a2"} - {first}).pop()
    assert host[other].reclaim_step == Step.RESTART
    assert "for checkpoints (0 B left of what the checkpoint_host_memory setting allows)" in host[other].reason


def test_an_idle_lease_due_for_a_checkpoint_waits_for_release_timeout_when_the_budget_is_full():
    """Adaptive timeouts checkpoint a kernel early because its pauses are long; with no room for
    the checkpoint, the kernel keeps its GPU until release_timeout instead of losing its state."""

    def long_pauses(budget):
        cfg = SchedConfig(checkpoint_host_memory=budget, release_timeout=3600)
        host = Host(gpus(1), cfg=cfg, caps=CHECKPOINT)
        host.claim("a", "alice")
        host.kernel("a", memory=8 * GiB)
        host.tick(0)
        # A history of long pauses: the adaptive timeout checkpoints after a short idle spell.
        host.leases["a"] = replace(host["a"], gaps=(5000.0,) * 8)
        return host

    roomy = long_pauses(16 * GiB)
    roomy.tick(1200)
    assert roomy["a"].state == LeaseState.SUSPENDED

    full = long_pauses(4 * GiB)
    result = full.tick(1200)
    assert full["a"].state == LeaseState.IDLE
    assert "reclaim" not in full.kinds("a", result) and "notice" not in full.kinds("a", result)
    full.tick(3600)
    assert full["a"].reclaim_step == Step.RESTART
    assert "would not fit in the host memory left for checkpoints" in full["a"].reason


def test_the_forecast_says_a_checkpoint_will_not_fit():
    host = two_borrowed_leases(budget=4 * GiB)
    ahead = forecast(host["a1"], list(host.leases.values()), 100.0, host.cfg, CHECKPOINT, host.devices)
    assert ahead.step == Step.RESTART
    assert "would not fit in the host memory left for checkpoints" in ahead.reason
