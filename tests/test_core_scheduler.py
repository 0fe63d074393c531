"""One scheduling pass after another, as the arbiter runs them, told as the user would see it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from jupyter_gpusched.core import (
    SHARED,
    Capabilities,
    ConflictError,
    Device,
    GiB,
    Health,
    KernelActivity,
    LeaseState,
    SchedConfig,
    SchedulingError,
    Step,
    admit,
    keep,
    new_claim,
    plan,
    released,
    request_resume,
    step_done,
    step_failed,
    suspended,
)
from jupyter_gpusched.core.ladder import choose_step

CHECKPOINT = Capabilities(checkpoint=True, checkpoint_reason="")
NO_CHECKPOINT = Capabilities(checkpoint=False, checkpoint_reason="driver older than 570")


def gpus(n, name="GPU", **kw):
    return [Device(f"GPU-{i}", i, name, **kw) for i in range(n)]


class Host:
    """A minimal arbiter: admits claims, runs passes and carries out what they decide."""

    def __init__(self, devices, cfg=None, caps=NO_CHECKPOINT, **cfg_kw):
        self.devices = list(devices)
        self.cfg = cfg or SchedConfig(adaptive=False, **cfg_kw)
        self.caps = caps
        self.leases = {}
        self.activity = {}
        self.now = 0.0
        self.last = None

    def claim(self, lease_id, user, **kw):
        lease = new_claim(lease_id, f"k-{lease_id}", user, self.now, **kw)
        admit(lease, self.devices, self.leases.values(), self.cfg)
        self.leases[lease_id] = lease
        return lease

    def kernel(self, lease_id, *, busy=False, memory=1 * GiB):
        kernel_id = self.leases[lease_id].kernel_id
        self.activity[kernel_id] = KernelActivity(kernel_id, busy=busy, gpu_memory=memory)

    def at(self, now):
        self.now = float(now)
        return self

    def tick(self, now=None, *, carry_out=True):
        if now is not None:
            self.now = float(now)
        result = plan(self.devices, self.leases.values(), self.activity, self.now, self.cfg, self.caps)
        self.leases.update({lease.id: lease for lease in result.leases})
        self.last = result
        if carry_out:
            self.carry_out(result)
        return result

    def carry_out(self, result):
        for decision in result.decisions:
            if decision.kind != "reclaim":
                continue
            lease = self.leases[decision.lease.id]
            if lease.reclaim_step == Step.CHECKPOINT:
                self.leases[lease.id] = suspended(lease, self.now)
            elif lease.reclaim_step == Step.FREE_CACHE:
                self.leases[lease.id] = step_done(lease, Step.FREE_CACHE, "caches dropped")
            else:
                self.leases[lease.id] = released(lease, self.now, f"reclaimed: {lease.reclaim_step}")

    def release(self, lease_id):
        self.leases[lease_id] = released(self.leases[lease_id], self.now, "released by the user")

    def __getitem__(self, lease_id):
        return self.leases[lease_id]

    def kinds(self, lease_id, result=None):
        result = result or self.last
        return [d.kind for d in result.decisions if d.lease.id == lease_id]


# -- granting and queueing ----------------------------------------------------------------------


def test_two_claims_on_two_gpus_are_both_granted_on_different_gpus():
    host = Host(gpus(2))
    host.claim("a", "alice")
    host.claim("b", "bob")
    result = host.tick(1)
    assert host.kinds("a") == ["grant"] and host.kinds("b") == ["grant"]
    assert host["a"].state == host["b"].state == LeaseState.ACTIVE
    assert host["a"].devices != host["b"].devices
    assert {*host["a"].devices, *host["b"].devices} == {"GPU-0", "GPU-1"}
    assert host["a"].granted_at == 1.0
    assert result.queue == ()
    assert set(result.changed) == {"a", "b"}


def test_a_third_claim_waits_first_in_line_and_gets_the_first_gpu_given_back():
    host = Host(gpus(2))
    host.claim("a", "alice")
    host.claim("b", "bob")
    host.tick(1)
    host.at(2).claim("c", "carol")
    result = host.tick(2)
    assert host["c"].state == LeaseState.PENDING
    assert result.position("c") == 1
    assert result.queue == ("c",)
    assert host["c"].reason == "waiting for a GPU"
    freed = host["b"].devices

    host.at(5).release("b")
    host.tick(5)
    assert host.kinds("c") == ["grant"]
    assert host["c"].devices == freed
    assert host.last.position("c") is None


def test_a_pass_changes_nothing_it_has_no_reason_to():
    host = Host(gpus(2), idle_timeout=300)
    host.claim("a", "alice")
    host.kernel("a", busy=False)
    host.tick(1)
    host.tick(2)  # the kernel's GPU memory is first seen once the lease is held
    again = host.tick(3)
    assert again.changed == () and again.decisions == ()
    assert again.next_wakeup == 301  # when the lease will count idle


def test_claims_are_not_granted_on_a_drained_gpu_but_leases_on_it_carry_on():
    host = Host(gpus(2))
    host.claim("a", "alice")
    host.kernel("a", busy=True)
    host.tick(1)
    held = host["a"].devices[0]
    host.devices = [replace(d, health=Health.DRAINED) if d.uuid == held else d for d in host.devices]
    host.claim("b", "bob")
    host.claim("c", "carol")
    host.tick(2)
    assert host["a"].state == LeaseState.ACTIVE and host["a"].devices == (held,)
    granted = [lid for lid in "bc" if host[lid].state == LeaseState.ACTIVE]
    assert len(granted) == 1
    assert held not in host[granted[0]].devices


def test_a_big_claim_that_waited_long_enough_is_not_overtaken_by_small_ones():
    host = Host(gpus(2), backfill_wait=120, quotas={"*": 2})
    host.claim("a", "alice")
    host.kernel("a", busy=True)
    host.tick(0)
    host.at(1).claim("big", "bob", count=2)
    host.at(10).claim("s1", "carol")
    host.tick(10)
    # Early on, a small claim may use the GPU the big one cannot use yet.
    assert host["s1"].state == LeaseState.ACTIVE
    host.kernel("s1", busy=True)
    host.at(200).claim("s2", "dave")
    host.release("s1")
    result = host.tick(200)
    # Now the big claim holds the line: the free GPU is kept for it.
    assert host["s2"].state == LeaseState.PENDING
    assert result.queue == ("big", "s2")
    host.release("a")
    host.tick(201)
    assert host["big"].state == LeaseState.ACTIVE and len(host["big"].devices) == 2


def test_a_claim_within_quota_is_not_passed_over_because_a_bigger_one_of_its_user_cannot_fit():
    host = Host(gpus(2), quotas={"*": 1})
    host.claim("v0", "val")
    host.kernel("v0", busy=True)
    host.tick(0)
    host.claim("big", "uma", count=2, priority=1)  # cannot fit while val holds a GPU
    host.claim("small", "uma")  # within uma's quota of one, fits on the free GPU
    host.claim("more", "val")  # would take val beyond her quota
    result = host.tick(1)
    assert host["small"].state == LeaseState.ACTIVE
    assert host["more"].state == LeaseState.PENDING
    assert result.queue == ("big", "more")


def test_a_claim_within_quota_is_not_held_back_by_an_older_claim_of_its_user_that_would_borrow():
    host = Host(gpus(2), quotas={"user:uma": 2, "*": 0})
    host.claim("u1", "uma")
    host.kernel("u1", busy=True)
    host.tick(0)
    host.at(1).claim("big", "uma", count=2)  # would take uma to 3 GPUs of her 2
    host.at(2).claim("other", "oz")  # oz has no quota: he can only borrow
    host.at(3).claim("small", "uma")  # within uma's quota
    result = host.tick(3)
    assert host["small"].state == LeaseState.ACTIVE
    assert result.queue == ("other", "big")


# -- reclaiming idle leases ---------------------------------------------------------------------


def hybrid_with_a_borrowed_lease(**kw):
    """Alice holds two of two GPUs with a quota of one; both her kernels are idle."""
    host = Host(gpus(2), quotas={"*": 1}, **kw)
    host.claim("a1", "alice")
    host.tick(0)
    host.at(10).claim("a2", "alice")
    host.tick(10)
    assert host["a1"].devices != host["a2"].devices
    return host


def test_nobody_waiting_idle_leases_are_kept_until_release_timeout():
    host = hybrid_with_a_borrowed_lease(release_timeout=3600)
    host.tick(3000)
    assert host["a1"].state == host["a2"].state == LeaseState.IDLE
    result = host.tick(3600)
    assert host.kinds("a1", result) == ["notice"]
    assert host["a2"].state == LeaseState.IDLE
    assert result.next_wakeup == 3610


def test_a_borrowed_idle_lease_is_announced_for_reclaim_when_someone_waits():
    host = hybrid_with_a_borrowed_lease(contended_idle_timeout=60, grace_period=60)
    host.at(20).claim("b", "bob")
    result = host.tick(20)
    assert result.position("b") == 1
    assert not host.kinds("a2")
    assert result.next_wakeup == 70  # a2 will have been idle for contended_idle_timeout

    result = host.tick(70)
    assert host.kinds("a2") == ["notice"]
    a2 = host["a2"]
    assert a2.state == LeaseState.RECLAIMING
    assert a2.reclaim_step == Step.RESTART
    assert a2.reclaim_at == 70 + 60
    assert "beyond its user's guaranteed share" in a2.reason and "while bob waits for a GPU" in a2.reason
    assert a2.reclaim_step == Step.RESTART and "its GPU state cannot be kept (a restart is all that is left)" in a2.reason
    assert "driver older than 570" in a2.reason
    # Alice's first lease is within her quota: it is not touched.
    assert host["a1"].state == LeaseState.ACTIVE
    assert not host.kinds("a1")
    assert result.next_wakeup == 130

    host.tick(100)
    assert host["a2"].state == LeaseState.RECLAIMING and not host.kinds("a2")
    host.tick(130)
    assert host.kinds("a2") == ["reclaim"]
    assert host["a2"].state == LeaseState.RELEASED
    host.tick(131)
    assert host["b"].state == LeaseState.ACTIVE
    assert host["b"].devices == a2.devices


def test_a_lease_within_quota_is_kept_while_someone_waits_until_release_timeout():
    host = Host(gpus(1), quotas={"*": 1}, release_timeout=3600)
    host.claim("a", "alice")
    host.tick(0)
    host.at(1).claim("b", "bob")
    host.tick(3599)
    assert host["a"].state == LeaseState.IDLE
    assert host.last.position("b") == 1
    host.tick(3600)
    assert host.kinds("a") == ["notice"]


def test_an_announced_reclaim_is_cancelled_when_the_kernel_runs():
    host = hybrid_with_a_borrowed_lease()
    host.at(20).claim("b", "bob")
    host.tick(70)
    assert host["a2"].state == LeaseState.RECLAIMING
    host.kernel("a2", busy=True)
    host.tick(90)
    assert host.kinds("a2") == ["cancel"]
    a2 = host["a2"]
    assert a2.state == LeaseState.ACTIVE and a2.reclaim_at is None and a2.reclaim_step is None
    assert "reclaim cancelled" in a2.reason
    host.tick(130)
    assert host["a2"].state == LeaseState.ACTIVE
    assert host["b"].state == LeaseState.PENDING


def four_held_gpus_and_a_small_checkpoint_budget():
    """The scenario a new user met: B, D and E hold 8 GiB each (D and E run cells), C holds a GPU
    with no memory and ran a cell more recently than B; the host's checkpoint budget (4 GiB)
    cannot take an 8 GiB checkpoint. Then A's claim waits. B is the longest idle."""
    host = Host(gpus(4), caps=CHECKPOINT, policy="dynamic", idle_timeout=30, contended_idle_timeout=30,
                grace_period=60, checkpoint_host_memory=4 * GiB, reclaim_fallback="restart")
    for lease_id, user in (("b", "bob"), ("c", "carol"), ("d", "dave"), ("e", "erin")):
        host.claim(lease_id, user)
    host.tick(0)
    for lease_id, memory in (("b", 8 * GiB), ("c", 0), ("d", 8 * GiB), ("e", 8 * GiB)):
        host.kernel(lease_id, busy=True, memory=memory)
    host.tick(1)
    host.kernel("b", busy=False, memory=8 * GiB)
    host.tick(2)
    host.kernel("c", busy=False, memory=0)
    host.tick(20)
    return host


def test_an_announced_restart_is_called_off_when_a_step_that_keeps_state_serves_the_claim():
    host = four_held_gpus_and_a_small_checkpoint_budget()
    host.at(40).claim("a", "alice")
    host.tick(40)
    b = host["b"]
    assert b.state == LeaseState.RECLAIMING and b.reclaim_step == Step.RESTART, b.reason
    assert host.kinds("b")[-1] == "notice"
    assert host["c"].state == LeaseState.ACTIVE, "carol's kernel is not idle long enough yet"
    # Carol's lease, holding no memory, is idle long enough at 50: releasing it serves alice.
    carols = host["c"].devices
    host.tick(50)
    assert host.kinds("c")[-1] == "reclaim" and host["c"].state == LeaseState.RELEASED
    assert host.kinds("b") == ["cancel"]
    b = host["b"]
    assert b.state == LeaseState.IDLE and b.reclaim_step is None and b.reclaim_at is None
    assert b.reason.startswith("restart called off: the waiting claim is served without it")
    host.tick(51)
    assert host["a"].state == LeaseState.ACTIVE and host["a"].devices == carols
    # Nothing is restarted afterwards: bob's grace period passes and he keeps his GPU.
    host.tick(101)
    assert host["b"].state == LeaseState.IDLE


def test_a_release_is_chosen_before_a_restart_that_would_serve_the_same_claim():
    host = four_held_gpus_and_a_small_checkpoint_budget()
    host.at(60).claim("a", "alice")
    host.tick(60)
    # Both bob's and carol's kernels are idle long enough; bob's the longer, but his step would
    # restart it, carol's keeps her state (she held no memory).
    assert host.kinds("c")[-1] == "reclaim"
    assert host["c"].state == LeaseState.RELEASED
    assert host["b"].state == LeaseState.IDLE and "notice" not in host.kinds("b")


def test_two_checkpoints_that_do_not_both_fit_the_budget_are_not_both_counted_gentle():
    host = Host(gpus(2), caps=CHECKPOINT, policy="dynamic", idle_timeout=30, contended_idle_timeout=30,
                grace_period=60, checkpoint_host_memory=10 * GiB, reclaim_fallback="restart")
    host.claim("b", "bob")
    host.claim("c", "carol")
    host.tick(0)
    host.kernel("b", memory=6 * GiB)
    host.kernel("c", memory=6 * GiB)
    host.tick(1)
    host.at(60).claim("a", "alice", count=2)
    host.tick(60)
    states = sorted((str(host[lid].state), str(host[lid].reclaim_step)) for lid in ("b", "c"))
    assert states == [("reclaiming", "restart"), ("suspended", "None")], "12 GiB of checkpoints do not fit 10 GiB"


def test_a_checkpoint_under_way_is_not_joined_by_a_second_one_for_the_same_claim():
    """bob's 8 GiB checkpoint is under way for alice's claim, and it holds most of the 10 GiB
    budget; the next pass does not take carol's GPU too."""
    host = Host(gpus(3), caps=CHECKPOINT, policy="dynamic", idle_timeout=30, contended_idle_timeout=30,
                grace_period=60, checkpoint_host_memory=10 * GiB, reclaim_fallback="restart")
    for lease_id, user in (("b", "bob"), ("c", "carol"), ("d", "dave")):
        host.claim(lease_id, user)
    host.tick(0)
    host.kernel("b", memory=8 * GiB)
    host.kernel("c", memory=2 * GiB)
    host.kernel("d", busy=True, memory=GiB)
    host.tick(1)
    host.at(60).claim("a", "alice")
    host.tick(60, carry_out=False)
    assert host["b"].state == LeaseState.RECLAIMING and host["b"].reclaim_step == Step.CHECKPOINT
    host.tick(62, carry_out=False)
    assert host["c"].state == LeaseState.IDLE and not host.kinds("c"), "one GPU is enough for one claim"


def test_no_restart_is_announced_while_a_checkpoint_under_way_serves_the_claim():
    host = Host(gpus(2), caps=CHECKPOINT, policy="dynamic", idle_timeout=30, contended_idle_timeout=30,
                grace_period=60, checkpoint_host_memory=10 * GiB, reclaim_fallback="restart")
    host.claim("r", "rob")
    host.claim("g", "gina")
    host.tick(0)
    host.kernel("r", memory=12 * GiB)  # more than the budget: only a restart could take it
    host.kernel("g", busy=True, memory=8 * GiB)
    host.tick(1)
    host.kernel("g", memory=8 * GiB)
    host.tick(2)
    host.at(60).claim("a", "alice")
    host.tick(60, carry_out=False)
    assert host["g"].reclaim_step == Step.CHECKPOINT
    host.tick(65, carry_out=False)
    assert host["r"].state == LeaseState.IDLE and "notice" not in host.kinds("r")
    host.leases["g"] = suspended(host["g"], 66)
    host.tick(70)
    assert host["a"].state == LeaseState.ACTIVE and host["r"].state == LeaseState.IDLE


def test_the_checkpoint_chosen_for_a_claim_comes_first_out_of_the_budget():
    """uma's idle lease is past release_timeout (any step) and gus's borrowed one is wanted for
    alice: the checkpoint alice's claim counted on is not turned into a restart because uma's
    lease came first in another order."""
    host = Host(gpus(3), caps=CHECKPOINT, policy="hybrid", quotas={"*": 1}, idle_timeout=30,
                contended_idle_timeout=30, grace_period=60, release_timeout=100,
                checkpoint_host_memory=10 * GiB, reclaim_fallback="restart")
    for lease_id, user in (("bu", "uma"), ("g1", "gus"), ("g2", "gus")):
        host.claim(lease_id, user)
        host.tick(0)
    for lease_id in ("bu", "g1", "g2"):
        host.kernel(lease_id, busy=True, memory=8 * GiB)
    host.tick(1)
    host.kernel("bu", memory=8 * GiB)
    host.tick(2)
    host.kernel("g2", memory=8 * GiB)
    host.tick(50)
    host.kernel("g1", memory=8 * GiB)
    host.tick(95)
    host.at(102).claim("a", "alice")
    host.tick(102, carry_out=False)
    assert host["g2"].reclaim_step == Step.CHECKPOINT, host["g2"].reason
    assert "reclaim" in host.kinds("g2")


def test_an_announced_restart_becomes_a_checkpoint_when_the_budget_has_room_again():
    host = Host(gpus(2), caps=CHECKPOINT, policy="dynamic", idle_timeout=30, contended_idle_timeout=30,
                grace_period=60, checkpoint_host_memory=10 * GiB, reclaim_fallback="restart")
    host.claim("s", "sam")
    host.claim("b", "bob")
    host.tick(0)
    host.kernel("s", busy=True, memory=8 * GiB)
    host.kernel("b", memory=8 * GiB)
    host.tick(1)
    host.leases["s"] = suspended(replace(host["s"], state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT,
                                         memory_held=8 * GiB), 1)  # sam's 8 GiB checkpoint holds the budget
    host.claim("d", "dave")  # and dave's running kernel takes sam's GPU
    host.tick(2)
    host.kernel("d", busy=True, memory=GiB)
    host.tick(3)
    assert host["d"].state == LeaseState.ACTIVE
    host.at(60).claim("a", "alice")
    host.tick(60)
    assert host["b"].reclaim_step == Step.RESTART, host["b"].reason
    host.release("s")  # sam's kernel ends: its checkpoint leaves the budget
    host.tick(70)
    assert host["b"].state == LeaseState.SUSPENDED, host["b"].reason
    said = [d.reason for d in host.last.decisions if d.lease.id == "b" and d.kind == "reclaim"]
    assert said and "instead of the restart announced" in said[0], said


def test_an_announced_reclaim_is_cancelled_when_the_lease_is_kept():
    host = hybrid_with_a_borrowed_lease(max_keep=7200)
    host.at(20).claim("b", "bob")
    host.tick(70)
    host.leases["a2"] = keep(host["a2"], 1800, 80, host.cfg)
    assert host["a2"].state == LeaseState.ACTIVE
    assert host["a2"].keep_until == 1880
    assert host["a2"].reason == "reclaim cancelled: kept by the user"
    for now in (130, 1000, 1879):
        host.tick(now)
        assert host["a2"].state != LeaseState.RECLAIMING
    assert host["b"].state == LeaseState.PENDING
    # Once the keep runs out, the lease (idle since it was kept) is announced again.
    host.tick(1880)
    assert host.kinds("a2") == ["notice"]


def test_keep_is_bounded_by_max_keep():
    host = hybrid_with_a_borrowed_lease(max_keep=7200)
    with pytest.raises(SchedulingError, match="limited to 7200 seconds"):
        keep(host["a2"], 7201, 20, host.cfg)
    with pytest.raises(SchedulingError):
        keep(host["a2"], -1, 20, host.cfg)
    kept = keep(host["a2"], 7200, 20, host.cfg)
    assert kept.keep_until == 7220
    assert keep(kept, 0, 30, host.cfg).keep_until is None
    gone = released(host["a2"], 30, "done")
    with pytest.raises(ConflictError):
        keep(gone, 60, 30, host.cfg)


def test_keep_does_not_call_off_a_checkpoint_already_under_way():
    host = hybrid_with_a_borrowed_lease(caps=CHECKPOINT)
    host.at(20).claim("b", "bob")
    host.tick(70, carry_out=False)
    assert host["a2"].reclaim_step == Step.CHECKPOINT
    kept = keep(host["a2"], 600, 71, host.cfg)
    assert kept.state == LeaseState.RECLAIMING and kept.reclaim_step == Step.CHECKPOINT
    assert kept.keep_until == 671


def test_the_static_policy_never_takes_a_gpu_back():
    host = Host(gpus(1), policy="static", release_timeout=3600)
    host.claim("a", "alice")
    host.tick(0)
    host.at(1).claim("b", "bob")
    for now in (100, 3600, 86400 * 10):
        result = host.tick(now)
        assert not [d for d in result.decisions if d.kind in ("notice", "reclaim")]
    assert host["a"].holding
    assert host.last.position("b") == 1


def test_the_dynamic_policy_takes_back_any_idle_lease_when_someone_waits():
    host = Host(gpus(1), policy="dynamic", quotas={"*": 1}, idle_timeout=300)
    host.claim("a", "alice")
    host.tick(0)
    host.at(1).claim("b", "bob")
    host.tick(299)
    assert not host.kinds("a")
    host.tick(300)
    assert host.kinds("a") == ["idle", "notice"]
    assert not host["a"].reason.startswith("borrowed")


def test_only_the_idle_leases_a_waiting_claim_needs_are_taken_back():
    host = Host(gpus(3), policy="dynamic", idle_timeout=30)
    for lease_id, user in (("x1", "xena"), ("x2", "yves"), ("x3", "zoe")):
        host.at(0).claim(lease_id, user)
    host.tick(0)
    host.at(1).claim("b", "bob")
    host.tick(50)
    # The longest idle is chosen; one lease frees what bob needs.
    assert sum(host[lid].state == LeaseState.RECLAIMING for lid in ("x1", "x2", "x3")) == 1


def test_an_idle_lease_on_a_gpu_a_busy_lease_shares_is_not_reclaimed_for_nothing():
    host = Host(gpus(3), policy="dynamic", idle_timeout=30)
    host.claim("v1", "val", mode=SHARED, memory=10 * GiB)
    host.claim("busy", "bea", mode=SHARED, memory=10 * GiB)
    host.kernel("busy", busy=True)
    host.tick(0)
    assert host["v1"].devices == host["busy"].devices
    host.at(50).claim("v2", "vic")
    host.tick(50)
    host.at(100).claim("two", "tom", count=2)
    host.tick(150)
    # Freeing v1 would not free its GPU (bea is using it): only v2 is asked to go.
    assert host["v2"].state == LeaseState.RECLAIMING
    assert host["v1"].state == LeaseState.IDLE


def test_a_claim_held_back_only_by_a_reservation_costs_nobody_their_lease():
    host = Host(gpus(3), policy="dynamic", idle_timeout=30, backfill_wait=120)
    host.claim("busy", "bea")
    host.kernel("busy", busy=True)
    host.claim("idle", "ivan")
    host.tick(0)
    host.at(1).claim("big", "bob", count=3)
    host.at(130).claim("small", "sam")
    result = host.tick(130)
    assert result.queue == ("big", "small")
    # Taking ivan's lease back would neither let the 3-GPU claim in (bea is busy) nor is it
    # needed for the small one, which fits on the free GPU as soon as the line moves.
    assert host["idle"].state == LeaseState.IDLE
    assert not [d for d in result.decisions if d.kind in ("notice", "reclaim")]


def test_reclaim_fallback_none_never_disrupts_a_kernel():
    host = hybrid_with_a_borrowed_lease(reclaim_fallback="none")
    host.at(20).claim("b", "bob")
    for now in (70, 3600, 86400):
        result = host.tick(now)
        assert not [d for d in result.decisions if d.kind in ("notice", "reclaim")]
        assert host["a1"].holding and host["a2"].holding
    assert host["a2"].state == LeaseState.IDLE


def test_reclaim_fallback_shutdown_is_announced_as_a_shutdown():
    host = hybrid_with_a_borrowed_lease(reclaim_fallback="shutdown")
    host.at(20).claim("b", "bob")
    host.tick(70)
    assert host["a2"].reclaim_step == Step.SHUTDOWN
    assert host["a2"].reclaim_step == Step.SHUTDOWN


def test_without_a_grace_period_a_disruptive_reclaim_happens_at_once():
    host = hybrid_with_a_borrowed_lease(grace_period=0)
    host.at(20).claim("b", "bob")
    host.tick(70)
    assert host.kinds("a2") == ["reclaim"]
    assert host["a2"].state == LeaseState.RELEASED


def test_a_kernel_without_gpu_memory_is_released_without_notice():
    host = hybrid_with_a_borrowed_lease()
    host.kernel("a2", memory=0)
    host.at(20).claim("b", "bob")
    host.tick(70)
    assert host.kinds("a2") == ["reclaim"]
    assert host["a2"].state == LeaseState.RELEASED
    host.tick(71)
    assert host["b"].state == LeaseState.ACTIVE


# -- checkpoint, suspend and resume -------------------------------------------------------------


def test_a_checkpointed_lease_is_restored_onto_its_home_gpu():
    host = hybrid_with_a_borrowed_lease(caps=CHECKPOINT)
    home = host["a2"].devices
    host.at(20).claim("b", "bob")
    result = host.tick(70)
    assert host.kinds("a2", result) == ["reclaim"]  # a checkpoint loses nothing: no notice
    a2 = host["a2"]
    assert a2.state == LeaseState.SUSPENDED and a2.home == home and a2.devices == ()
    host.kernel("b", busy=True)
    host.tick(71)
    assert host["b"].devices == home

    # Alice runs a cell: her lease asks to come back and waits for its own GPU.
    host.leases["a2"] = request_resume(host["a2"], 100)
    host.release("a1")
    result = host.tick(100)
    assert host["a2"].state == LeaseState.PENDING
    assert result.position("a2") == 1
    assert host["a2"].reason == "waiting for the GPU it was checkpointed from to be free"

    host.release("b")
    host.tick(200)
    assert host.kinds("a2") == ["grant"]
    assert host["a2"].devices == home
    assert host["a2"].reason.startswith("restored onto")


def suspended_on(devices, home, caps):
    host = Host(devices, caps=caps)
    host.claim("s", "sue")
    host.tick(0)
    host.leases["s"] = replace(host["s"], devices=(home,))
    host.leases["s"] = request_resume(suspended(host["s"], 10), 20)
    return host


def test_with_remapping_a_restore_may_move_to_a_gpu_of_the_same_model():
    devices = [Device("GPU-0", 0, "A100"), Device("GPU-1", 1, "H100"), Device("GPU-2", 2, "A100")]
    host = suspended_on(devices, "GPU-0", Capabilities(checkpoint=True, remap=True))
    host.claim("x", "xena")
    host.kernel("x", busy=True)
    host.leases["x"] = replace(host["x"], state=LeaseState.ACTIVE, devices=("GPU-0",))
    host.tick(30)
    assert host["s"].devices == ("GPU-2",)
    assert host["s"].reason.startswith("restored onto")


def test_with_remapping_a_restore_never_moves_to_another_model():
    devices = [Device("GPU-0", 0, "A100"), Device("GPU-1", 1, "H100")]
    host = suspended_on(devices, "GPU-0", Capabilities(checkpoint=True, remap=True))
    host.claim("x", "xena")
    host.kernel("x", busy=True)
    host.leases["x"] = replace(host["x"], state=LeaseState.ACTIVE, devices=("GPU-0",))
    host.tick(30)
    assert host["s"].state == LeaseState.PENDING


def test_without_remapping_a_restore_waits_for_home_even_with_other_gpus_free():
    host = suspended_on(gpus(2), "GPU-0", CHECKPOINT)
    host.claim("x", "xena")
    host.kernel("x", busy=True)
    host.leases["x"] = replace(host["x"], state=LeaseState.ACTIVE, devices=("GPU-0",))
    host.tick(30)
    assert host["s"].state == LeaseState.PENDING


def test_a_restore_waiting_for_its_busy_home_gpu_holds_that_gpu_only():
    host = suspended_on(gpus(3), "GPU-0", CHECKPOINT)
    host.claim("x", "xena")
    host.kernel("x", busy=True)
    host.leases["x"] = replace(host["x"], state=LeaseState.ACTIVE, devices=("GPU-0",))
    host.tick(30)
    host.at(300).claim("n", "ned")  # the restore has waited past backfill_wait by now
    host.tick(300)
    assert host["n"].state == LeaseState.ACTIVE and host["n"].devices != ("GPU-0",)
    assert host["s"].state == LeaseState.PENDING
    host.release("x")
    host.at(301).claim("m", "mia")
    host.tick(301)
    # Once its home is free, the restore gets it ahead of the newer claim.
    assert host["s"].devices == ("GPU-0",)
    assert host["m"].devices == ("GPU-2",)


@pytest.mark.parametrize("health", [Health.LOST, Health.DRAINED])
def test_a_restore_whose_home_gpu_is_gone_does_not_hold_up_the_queue(health):
    host = suspended_on(gpus(2), "GPU-0", CHECKPOINT)
    host.devices[0] = replace(host.devices[0], health=health)
    host.tick(30)
    assert "drained or lost" in host["s"].reason
    host.at(1000).claim("n", "ned")
    host.tick(1000)
    assert host["n"].state == LeaseState.ACTIVE
    assert host["n"].devices == ("GPU-1",)


def test_a_failed_checkpoint_falls_through_to_the_next_step():
    host = hybrid_with_a_borrowed_lease(caps=CHECKPOINT)
    host.at(20).claim("b", "bob")
    host.tick(70, carry_out=False)
    host.leases["a2"] = step_failed(host["a2"], Step.CHECKPOINT, "the kernel uses UVM memory")
    assert host["a2"].state == LeaseState.IDLE
    host.tick(71)
    assert host.kinds("a2") == ["notice"]
    assert host["a2"].reclaim_step == Step.RESTART


# -- the reclaim ladder -------------------------------------------------------------------------


def idle_lease(**kw):
    lease = new_claim("l", "k", "alice", 0.0)
    return replace(lease, state=LeaseState.IDLE, devices=("GPU-0",), **kw)


def test_ladder_releases_a_lease_whose_kernel_holds_no_gpu_memory():
    step, why = choose_step(idle_lease(memory_held=0), SchedConfig(), CHECKPOINT)
    assert step == Step.RELEASE and "no GPU memory" in why


@pytest.mark.parametrize("held", [None, 1 * GiB])
def test_ladder_checkpoints_when_the_driver_can(held):
    step, why = choose_step(idle_lease(memory_held=held), SchedConfig(), CHECKPOINT)
    assert step == Step.CHECKPOINT and "checkpointed" in why
    assert not step.disruptive


@pytest.mark.parametrize(
    ("fallback", "expected"), [("restart", Step.RESTART), ("shutdown", Step.SHUTDOWN), ("none", None)]
)
def test_ladder_falls_back_as_configured(fallback, expected):
    cfg = SchedConfig(reclaim_fallback=fallback)
    step, why = choose_step(idle_lease(memory_held=GiB), cfg, NO_CHECKPOINT)
    assert step == expected
    if expected is not None:
        assert step.disruptive and "driver older than 570" in why


def test_ladder_skips_checkpoint_when_it_is_off_or_has_failed():
    step, why = choose_step(idle_lease(memory_held=GiB), SchedConfig(checkpoint="off"), CHECKPOINT)
    assert step == Step.RESTART and "checkpoints are turned off on this server (the checkpoint setting)" in why
    tried = idle_lease(memory_held=GiB, tried_steps=(Step.CHECKPOINT,))
    assert choose_step(tried, SchedConfig(), CHECKPOINT)[0] == Step.RESTART


def test_ladder_drops_caches_of_a_shared_lease_over_its_memory_first():
    over = replace(idle_lease(memory_held=20 * GiB), mode=SHARED, memory=10 * GiB)
    assert choose_step(over, SchedConfig(), NO_CHECKPOINT)[0] == Step.FREE_CACHE
    done = replace(over, tried_steps=(Step.FREE_CACHE,))
    assert choose_step(done, SchedConfig(), NO_CHECKPOINT)[0] == Step.RESTART


# -- admitting claims ---------------------------------------------------------------------------


def test_admit_rejects_more_gpus_than_the_host_can_hold():
    with pytest.raises(SchedulingError, match="asked for 3 GPUs but only 2 of the 2 healthy GPUs"):
        admit(new_claim("c", "k", "alice", 0, count=3), gpus(2), [], SchedConfig())
    devices = gpus(2) + [Device("GPU-9", 9, health=Health.DRAINED)]
    with pytest.raises(SchedulingError):
        admit(new_claim("c", "k", "alice", 0, count=3), devices, [], SchedConfig())


def test_admit_rejects_memory_above_the_largest_gpu():
    devices = [Device("GPU-0", 0, memory_total=40 * GiB), Device("GPU-1", 1, memory_total=80 * GiB)]
    with pytest.raises(SchedulingError, match=r"96.0 GiB per GPU is more than the largest GPU here \(80.0 GiB\)"):
        admit(new_claim("c", "k", "alice", 0, memory=96 * GiB), devices, [], SchedConfig())
    with pytest.raises(SchedulingError, match="only 1 of the 2"):
        admit(new_claim("c", "k", "alice", 0, count=2, memory=60 * GiB), devices, [], SchedConfig())
    admit(new_claim("c", "k", "alice", 0, memory=80 * GiB, mode=SHARED), devices, [], SchedConfig())


def test_admit_rejects_a_second_live_lease_for_one_kernel():
    first = new_claim("l1", "k1", "alice", 0)
    with pytest.raises(ConflictError, match="kernel k1 already has lease l1"):
        admit(new_claim("l2", "k1", "alice", 1), gpus(2), [first], SchedConfig())
    admit(first, gpus(2), [first], SchedConfig())  # admitting the same claim again is fine
    admit(new_claim("l2", "k1", "alice", 1), gpus(2), [released(first, 1, "done")], SchedConfig())


def test_admit_caps_the_claims_one_user_may_have_waiting():
    cfg = SchedConfig(max_pending_per_user=2)
    waiting = [new_claim(f"l{i}", f"k{i}", "alice", 0) for i in range(2)]
    with pytest.raises(ConflictError, match="alice already has 2 claims waiting"):
        admit(new_claim("l9", "k9", "alice", 1), gpus(1), waiting, cfg)
    admit(new_claim("l9", "k9", "bob", 1), gpus(1), waiting, cfg)
    admit(waiting[1], gpus(1), waiting, cfg)


def test_admit_says_when_there_is_nothing_to_schedule():
    with pytest.raises(SchedulingError, match="no GPUs"):
        admit(new_claim("c", "k", "alice", 0), [], [], SchedConfig())
    with pytest.raises(SchedulingError, match="drained or lost"):
        admit(new_claim("c", "k", "alice", 0), gpus(1, health=Health.LOST), [], SchedConfig())


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"count": 0}, "at least 1 GPU"),
        ({"count": True}, "whole number of GPUs"),
        ({"count": "2"}, "whole number of GPUs"),
        ({"mode": "both"}, "mode must be 'exclusive' or 'shared'"),
        ({"priority": 1.5}, "priority must be a whole number"),
    ],
)
def test_malformed_claims_are_refused_with_a_clear_message(kw, says):
    with pytest.raises(SchedulingError, match=says):
        new_claim("c", "k", "alice", 0, **kw)
    with pytest.raises(SchedulingError, match="kernel_id"):
        new_claim("c", "", "alice", 0)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"policy": "fifo"}, "policy must be one of static, dynamic, hybrid"),
        ({"reclaim_fallback": "kill"}, "reclaim_fallback must be one of"),
        ({"checkpoint": "on"}, "checkpoint must be 'auto' or 'off'"),
        ({"grace_period": -1}, "grace_period must be 0 or more seconds"),
        ({"max_keep": -1}, "max_keep must be 0 or more seconds"),
    ],
)
def test_bad_scheduling_config_is_refused_naming_the_trait(kw, says):
    with pytest.raises(SchedulingError, match=says):
        SchedConfig(**kw)


def test_the_same_inputs_give_the_same_plan():
    def run():
        host = hybrid_with_a_borrowed_lease()
        host.at(20).claim("b", "bob")
        host.at(21).claim("c", "carol", count=2)
        return [host.tick(now) for now in (20, 70, 130, 131)]

    assert run() == run()


# -- adaptive idle timeouts ---------------------------------------------------------------------


def adaptive_host(n=1, **cfg_kw):
    """Default timeouts (idle 300 s, release 3600 s), learning from pauses, checkpoint available."""
    return Host(gpus(n), cfg=SchedConfig(**cfg_kw), caps=CHECKPOINT)


def run_cells(host, lease_id, pauses, start, cell=0.5):
    """The kernel runs a cell at ``start`` and one after each pause; returns when the last ends."""
    kernel_id = host[lease_id].kernel_id
    t = start
    for pause in (0.0, *pauses):
        t += pause
        host.activity[kernel_id] = KernelActivity(kernel_id, busy=True, gpu_memory=2 * GiB)
        host.tick(t)
        t += cell
        host.activity[kernel_id] = KernelActivity(kernel_id, busy=False, last_busy_at=t, gpu_memory=2 * GiB)
        host.tick(t)
    return t


def depth(text):
    """How deeply parentheses nest in ``text``."""
    level = deepest = 0
    for char in text:
        level += char == "("
        deepest = max(deepest, level)
        level -= char == ")"
    return deepest


def watch_idle(host, lease_id, since, until):
    """Tick every 5 s from ``since`` until the lease is taken back.

    Returns the seconds idle when it was first marked idle and when it was taken back, and the
    reclaim decision's lease record.
    """
    marked = reclaimed = taken = None
    for waited in range(0, int(until - since) + 1, 5):
        result = host.tick(since + waited)
        if marked is None and host[lease_id].state != LeaseState.ACTIVE:
            marked = waited
        for decision in result.decisions:
            if decision.lease.id == lease_id and decision.kind in ("reclaim", "notice"):
                reclaimed, taken = waited, decision.lease
        if reclaimed is not None:
            break
    return marked, reclaimed, taken


def test_a_kernel_that_comes_back_within_seconds_keeps_its_gpu_while_nobody_waits():
    # Five cells about 4 s apart, then the user reads for a while: nobody else wants the GPU.
    host = adaptive_host()
    host.claim("a", "alice")
    host.tick(0)
    ended = run_cells(host, "a", [3.7, 3.6, 3.8, 3.7], start=0)
    marked, reclaimed, taken = watch_idle(host, "a", ended, ended + 4000)
    assert marked == 300  # idle_timeout, not sooner
    assert reclaimed == 3600  # release_timeout, not sooner
    assert taken.reclaim_step == Step.CHECKPOINT


def test_a_kernel_with_a_long_record_of_short_pauses_is_not_taken_back_early():
    host = adaptive_host()
    host.claim("a", "alice")
    host.tick(0)
    ended = run_cells(host, "a", [3.0] * 12, start=0)
    assert len(host["a"].gaps) == 12
    assert watch_idle(host, "a", ended, ended + 4000)[:2] == (300, 3600)


def test_other_kernels_long_pauses_do_not_cut_short_a_kernel_whose_own_pauses_are_short():
    host = adaptive_host(2)
    host.claim("b", "bob")
    host.tick(0)
    run_cells(host, "b", [1800.0] * 8, start=0)
    host.at(host.now).claim("a", "alice")
    host.tick()
    ended = run_cells(host, "a", [3.7, 3.6, 3.8, 3.7], start=host.now)
    assert watch_idle(host, "a", ended, ended + 4000)[:2] == (300, 3600)


def test_a_kernel_whose_own_pauses_are_long_is_checkpointed_early_while_nobody_waits():
    host = adaptive_host()
    host.claim("a", "alice")
    host.tick(0)
    ended = run_cells(host, "a", [1800.0] * 8, start=0)
    marked, reclaimed, taken = watch_idle(host, "a", ended, ended + 4000)
    assert marked < 300 and reclaimed < 3600
    assert taken.reclaim_step == Step.CHECKPOINT
    assert "usually stays away" in taken.reason and depth(taken.reason) <= 1


def test_a_kernel_is_judged_by_its_own_pauses_counted_once():
    # Four long pauses of its own are too few to learn from...
    host = adaptive_host(2)
    host.claim("a", "alice")
    host.tick(0)
    ended = run_cells(host, "a", [1800.0] * 4, start=0)
    assert watch_idle(host, "a", ended, ended + 4000)[:2] == (300, 3600)
    # ...while four more of another kernel's make enough.
    host = adaptive_host(2)
    host.claim("b", "bob")
    host.tick(0)
    run_cells(host, "b", [1800.0] * 4, start=0)
    host.at(host.now).claim("a", "alice")
    host.tick()
    ended = run_cells(host, "a", [1800.0] * 4, start=host.now)
    marked, reclaimed, _ = watch_idle(host, "a", ended, ended + 4000)
    assert marked < 300 and reclaimed < 3600


def test_idle_reasons_stay_true_and_do_not_nest():
    host = adaptive_host()
    host.claim("a", "alice")
    host.tick(0)
    ended = run_cells(host, "a", [3.7], start=0)
    host.tick(ended + 300)
    assert host["a"].state == LeaseState.IDLE
    said = host["a"].reason
    assert said == "idle: no cell and no GPU use for 5m00s"
    host.tick(ended + 3000)
    assert host["a"].reason == said  # still true 50 minutes on
    host.tick(ended + 3600, carry_out=False)
    assert host["a"].reclaim_step == Step.CHECKPOINT
    assert "release_timeout" in host["a"].reason and depth(host["a"].reason) <= 1


def test_a_disruptive_reclaim_reason_does_not_nest_parentheses():
    caps = Capabilities(checkpoint=False, checkpoint_reason="the driver is 550 (570 or later checkpoints)")
    host = hybrid_with_a_borrowed_lease(contended_idle_timeout=60, grace_period=60)
    host.caps = caps
    host.at(20).claim("b", "bob")
    host.tick(70)
    reason = host["a2"].reason
    assert host["a2"].reclaim_step == Step.RESTART
    assert "while bob waits" in reason and "570 or later" in reason
    assert depth(reason) <= 1
