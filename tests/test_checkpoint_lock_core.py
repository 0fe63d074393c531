"""A checkpoint whose lock timed out: the driver checkpointer says so, the lease stays active, and the
core tries again later, not at once."""

from __future__ import annotations

import pytest

from jupyter_gpusched.core import Capabilities, Device, GiB, Lease, LeaseState, SchedConfig, Step, plan
from jupyter_gpusched.core.lifecycle import lock_timed_out
from jupyter_gpusched.reclaim.checkpoint import CUDA_ERROR_TIMEOUT, CheckpointError, DriverCheckpointer, LockTimeout

T0 = 1_000_000.0
DEVICES = (Device("G0", 0),)
CHECKPOINT = Capabilities(checkpoint=True, checkpoint_reason="driver 570")
WHY = "not checkpointed: the kernel's GPU work did not pause within 30s (the checkpoint lock timed out)"


def reclaiming() -> Lease:
    return Lease(
        id="a", kernel_id="ka", user="alice", state=LeaseState.RECLAIMING, devices=("G0",),
        created_at=T0 - 1000, queued_at=T0 - 1000, granted_at=T0 - 1000, last_active_at=T0 - 600,
        memory_held=2 * GiB, reclaim_step=Step.CHECKPOINT, reclaim_at=T0 - 30, reason="idle while someone waits",
    )


def waiter() -> Lease:
    return Lease(
        id="w", kernel_id="kw", user="bob", state=LeaseState.PENDING, created_at=T0 - 100, queued_at=T0 - 100,
        last_active_at=T0 - 100, reason="waiting for a GPU",
    )


def test_a_lock_that_timed_out_leaves_the_lease_active_and_the_checkpoint_is_tried_again_later():
    cfg = SchedConfig(policy="dynamic", idle_timeout=300, contended_idle_timeout=60, grace_period=60)
    lease = lock_timed_out(reclaiming(), T0, WHY)
    assert lease.state == LeaseState.ACTIVE and lease.devices == ("G0",) and lease.reason == WHY
    assert lease.reclaim_step is None and lease.reclaim_at is None
    assert Step.CHECKPOINT not in lease.tried_steps, "the ladder does not go on to a disruptive step"

    # Someone still waits: the next passes leave the lease alone until its idle clock runs out again.
    leases = [lease, waiter()]
    for now in (T0, T0 + 2, T0 + 30):
        result = plan(DEVICES, leases, {}, now, cfg, CHECKPOINT)
        assert result.lease("a").state == LeaseState.ACTIVE, now
        assert result.lease("w").state == LeaseState.PENDING
        assert result.next_wakeup is not None and result.next_wakeup <= T0 + 300
        leases = list(result.leases)
    # Then the checkpoint is tried again, not a restart.
    now = T0 + 300
    result = plan(DEVICES, leases, {}, now, cfg, CHECKPOINT)
    again = result.lease("a")
    assert again.state == LeaseState.RECLAIMING and again.reclaim_step == Step.CHECKPOINT, again


def test_a_lock_timeout_on_a_lease_no_longer_reclaiming_changes_nothing():
    active = Lease(id="a", kernel_id="ka", user="alice", state=LeaseState.ACTIVE, devices=("G0",))
    assert lock_timed_out(active, T0, WHY) is active


class _FakeDriver:
    """The few driver calls a checkpoint makes; the lock answers ``lock_result``."""

    def __init__(self, lock_result: int) -> None:
        self.lock_result = lock_result
        self.calls: list[tuple] = []

    class CUcheckpointLockArgs:
        timeoutMs = 0

    def cuCheckpointProcessLock(self, pid, args):
        self.calls.append(("lock", pid, args.timeoutMs))
        return (self.lock_result,)

    def cuCheckpointProcessCheckpoint(self, pid, args):
        self.calls.append(("checkpoint", pid))
        return (0,)

    def cuCheckpointProcessUnlock(self, pid, args):
        self.calls.append(("unlock", pid))
        return (0,)


def test_the_driver_checkpointer_says_when_its_lock_timed_out():
    driver = _FakeDriver(CUDA_ERROR_TIMEOUT)
    checkpointer = DriverCheckpointer(driver, lock_timeout_ms=250)
    with pytest.raises(LockTimeout) as raised:
        checkpointer.checkpoint(42)
    assert raised.value.timeout_ms == 250
    assert driver.calls == [("lock", 42, 250)], "nothing checkpointed, nothing to unlock"

    other = _FakeDriver(1)
    with pytest.raises(CheckpointError) as raised:
        DriverCheckpointer(other).checkpoint(42)
    assert not isinstance(raised.value, LockTimeout)

    fine = _FakeDriver(0)
    DriverCheckpointer(fine).checkpoint(7)
    assert fine.calls == [("lock", 7, 30_000), ("checkpoint", 7)]
