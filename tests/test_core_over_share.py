"""A shared lease over its memory share: notice, then free-cache, then the fallback where it hurts.

Passes of the pure core on a virtual clock (the arbiter and the simulator run the same ones).
"""

from __future__ import annotations

from jupyter_gpusched.core import GiB, LeaseState, Step, keep
from jupyter_gpusched.core.ladder import OVER_SHARE_RECHECK, OVER_SHARE_SLACK, over_share

from test_core_scheduler import Host, gpus

HEAD = "over its memory share: its processes hold more than the 16.0 GiB it claimed on GPU 0"


def shared(host, lease_id, user, memory=16 * GiB):
    return host.claim(lease_id, user, mode="shared", memory=memory)


def two_sharing(**cfg):
    """Alice's and Bob's shared leases of 16 GiB on the one GPU of the host, both granted."""
    host = Host(gpus(1), **cfg)
    shared(host, "a", "alice")
    shared(host, "b", "bob")
    host.kernel("a", busy=True, memory=4 * GiB)
    host.kernel("b", busy=True, memory=4 * GiB)
    host.tick(0)
    assert host["a"].devices == host["b"].devices == ("GPU-0",)
    return host


def told(host, lease_id):
    """What the pass decided about the lease, less going back to active after the free-cache
    step (which leaves a lease idle, as it does after an idle reclaim)."""
    return [kind for kind in host.kinds(lease_id) if kind != "active"]


def over_then_free_cache(host, memory=20 * GiB):
    """Alice's kernel goes over its share; the notice comes, then the free-cache step."""
    host.kernel("a", busy=True, memory=memory)
    host.tick(1)
    assert host.kinds("a") == ["over_share"]
    assert host["a"].reason == f"{HEAD}; its framework caches are dropped if it stays over"
    assert host["a"].over_share_since == 1.0
    assert host["a"].state == LeaseState.ACTIVE
    # Still over, but not yet a recheck later: nothing more yet.
    host.tick(1 + OVER_SHARE_RECHECK / 2)
    assert host.kinds("a") == []
    host.tick(1 + OVER_SHARE_RECHECK, carry_out=False)
    assert host.kinds("a") == ["reclaim"]
    assert host["a"].state == LeaseState.RECLAIMING and host["a"].reclaim_step == Step.FREE_CACHE
    assert host["a"].reason == f"{HEAD}; dropping its framework caches"
    host.carry_out(host.last)  # the kernel says it dropped its caches
    assert Step.FREE_CACHE in host["a"].tried_steps


def test_within_the_share_and_its_slack_nothing_happens():
    host = two_sharing()
    host.kernel("a", busy=True, memory=16 * GiB + OVER_SHARE_SLACK)
    for t in range(1, 10):
        host.tick(t)
        assert host.kinds("a") == []
    assert host["a"].over_share_since is None and host["a"].state == LeaseState.ACTIVE
    assert not over_share(host["a"])
    # An exclusive lease, or a shared one without a share, is never over anything.
    host = Host(gpus(2))
    host.claim("x", "carol")
    host.claim("y", "dave", mode="shared")
    host.kernel("x", busy=True, memory=70 * GiB)
    host.kernel("y", busy=True, memory=70 * GiB)
    host.tick(0)
    host.tick(5)
    assert host["x"].over_share_since is None and host["y"].over_share_since is None


def test_over_the_share_notice_then_free_cache_then_restart_while_another_lease_shares_the_gpu():
    host = two_sharing()
    over_then_free_cache(host)
    # Still over after the caches were dropped, and Bob's lease shares the GPU: a restart after
    # the grace period, though the kernel is busy all along.
    host.tick(3)
    assert told(host, "a") == ["notice"]
    a = host["a"]
    assert a.state == LeaseState.RECLAIMING and a.reclaim_step == Step.RESTART and a.reclaim_at == 63.0
    assert a.reason == (
        f"{HEAD}; dropping its framework caches did not bring it within its share and another lease "
        "shares its GPU, so the kernel will be restarted after a 1m00s notice unless it frees GPU memory"
    )
    assert 63.0 == host.last.next_wakeup
    host.tick(30)
    assert host["a"].state == LeaseState.RECLAIMING, "running code does not call it off"
    # A keep is against idle reclaim: it does not call this off either.
    host.leases["a"] = keep(host["a"], 600, 31.0, host.cfg)
    host.tick(32)
    assert host["a"].state == LeaseState.RECLAIMING and host["a"].reclaim_at == 63.0
    host.tick(63)
    assert host.kinds("a") == ["reclaim"]
    assert host["a"].state == LeaseState.RELEASED
    # Bob's lease keeps its GPU.
    assert host["b"].state == LeaseState.ACTIVE and host["b"].devices == ("GPU-0",)
    assert host.kinds("b") == []


def test_shutdown_is_the_fallback_where_configured():
    host = two_sharing(reclaim_fallback="shutdown", grace_period=10)
    over_then_free_cache(host)
    host.tick(3)
    assert host["a"].reclaim_step == Step.SHUTDOWN and host["a"].reclaim_at == 13.0
    assert "so the kernel will be shut down after a 10s notice" in host["a"].reason


def test_back_within_the_share_calls_the_restart_off():
    host = two_sharing()
    over_then_free_cache(host)
    host.tick(3)
    assert host["a"].reclaim_step == Step.RESTART
    host.kernel("a", busy=True, memory=10 * GiB)  # the user deleted what was too much
    host.tick(10)
    assert host.kinds("a") == ["cancel"]
    a = host["a"]
    assert a.state == LeaseState.ACTIVE and a.reclaim_at is None and a.reclaim_step is None
    assert a.over_share_since is None and a.reason == "back within its memory share: the restart is off"
    host.tick(100)
    assert host["a"].state == LeaseState.ACTIVE


def test_dropping_the_caches_may_be_enough():
    host = two_sharing()
    over_then_free_cache(host)
    host.kernel("a", busy=True, memory=15 * GiB)
    host.tick(3)
    assert told(host, "a") == []
    assert host["a"].over_share_since is None and host["a"].reason == "back within its memory share"
    assert host["a"].state == LeaseState.ACTIVE


def test_nobody_hurt_no_disruptive_step_until_someone_comes():
    host = Host(gpus(1))
    shared(host, "a", "alice")
    host.kernel("a", busy=True, memory=4 * GiB)
    host.tick(0)
    over_then_free_cache(host, memory=40 * GiB)
    host.tick(3)
    assert told(host, "a") == ["over_share"]
    assert host["a"].state == LeaseState.ACTIVE
    assert host["a"].reason == (
        f"{HEAD}; dropping its framework caches did not bring it within its share; nobody else uses "
        "GPU 0 or waits for it, so the kernel keeps running (it will be restarted after a 1m00s notice "
        "if someone does)"
    )
    for t in (10, 100, 1000):
        host.tick(t)
        assert host.kinds("a") == [], "told once"
        assert host["a"].state == LeaseState.ACTIVE
    # Now Bob's shared claim is granted on that GPU: the over-share can hurt him.
    host.at(1001)
    shared(host, "b", "bob")
    host.kernel("b", busy=True, memory=1 * GiB)
    host.tick(1001)
    assert host.kinds("b") == ["grant"]
    assert told(host, "a") == ["notice"] and host["a"].reclaim_step == Step.RESTART
    # Bob leaves before the grace period is over: the restart is off again.
    host.release("b")
    host.tick(1030)
    assert host.kinds("a") == ["cancel"]
    assert host["a"].state == LeaseState.ACTIVE
    assert host["a"].reason.endswith("the restart is off: nobody else uses GPU 0 or waits for it any more")


def test_a_waiting_claim_is_hurt_too():
    host = Host(gpus(1))
    shared(host, "a", "alice")
    host.kernel("a", busy=True, memory=4 * GiB)
    host.tick(0)
    over_then_free_cache(host, memory=40 * GiB)
    host.at(2.5).claim("c", "carol")  # the whole GPU: it waits for Alice's lease
    host.tick(3)
    assert host["c"].state == LeaseState.PENDING
    assert told(host, "a") == ["notice"]
    assert "a claim waits for its GPU, so the kernel will be restarted" in host["a"].reason


def test_reclaim_fallback_none_keeps_the_kernel_with_a_clear_reason():
    host = two_sharing(reclaim_fallback="none")
    over_then_free_cache(host)
    host.tick(3)
    assert told(host, "a") == ["over_share"]
    assert host["a"].reason == (
        f"{HEAD}; dropping its framework caches did not bring it within its share; reclaim_fallback "
        "is 'none', so the kernel keeps running although another lease shares its GPU"
    )
    for t in (60, 600, 6000):
        host.tick(t)
        assert host["a"].state == LeaseState.ACTIVE and host["a"].reclaim_step is None
        assert host.kinds("a") == []


def test_the_rule_is_deterministic():
    runs = []
    for _ in range(2):
        host = two_sharing()
        over_then_free_cache(host)
        host.tick(3)
        runs.append((host["a"], host["b"], host.last.decisions))
    assert runs[0] == runs[1]


def test_an_idle_lease_over_its_share_is_handled_the_same_way():
    host = two_sharing()
    host.kernel("a", busy=False, memory=20 * GiB)
    host.tick(1)
    assert host.kinds("a") == ["over_share"]
    host.tick(2, carry_out=False)
    assert host["a"].reclaim_step == Step.FREE_CACHE
    host.carry_out(host.last)
    host.tick(3)
    assert host["a"].reclaim_step == Step.RESTART and host["a"].reclaim_at == 63.0
