"""Which idle lease a waiting claim takes: never a kernel said to run a cell before an idle one.

A hub broker believes a server's word that its kernel runs a cell only with evidence (its
processes' CPU or GPU use), so a kernel running a cell can count idle there. That word may not
keep a GPU for ever, but between two candidates it decides: the idle kernel's lease is taken,
even if the running one has counted idle for longer.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpusched.core import (
    Capabilities,
    Device,
    GiB,
    KernelActivity,
    LeaseState,
    SchedConfig,
    admit,
    new_claim,
    plan,
)

CHECKPOINT = Capabilities(checkpoint=True, checkpoint_reason="")
# The bad run's settings: idle after 3 s, taken for a waiting claim after 2 s.
CFG = SchedConfig(idle_timeout=3.0, contended_idle_timeout=2.0, adaptive=False, quotas={"*": 0.5})


def gpus(n):
    return [Device(f"GPU-{i}", i, "GPU") for i in range(n)]


class Host:
    def __init__(self, devices, cfg=CFG):
        self.devices, self.cfg = list(devices), cfg
        self.leases, self.activity, self.running = {}, {}, set()

    def claim(self, name, now):
        lease = new_claim(name, f"k-{name}", name, now)
        admit(lease, self.devices, self.leases.values(), self.cfg)
        self.leases[name] = lease

    def run(self, name, busy, memory=GiB):
        self.activity[f"k-{name}"] = KernelActivity(f"k-{name}", busy=busy, last_busy_at=None, gpu_memory=memory)

    def tick(self, now):
        result = plan(
            self.devices, self.leases.values(), self.activity, now, self.cfg, CHECKPOINT, running=frozenset(self.running)
        )
        self.leases.update({le.id: le for le in result.leases})
        return result

    def reclaimed(self, result):
        return [d.lease.id for d in result.decisions if d.kind in ("reclaim", "notice")]


def the_bad_run():
    """alice and bob hold a GPU each and compute; carol's first cell waits."""
    host = Host(gpus(2))
    host.claim("alice", 0.0)
    host.claim("bob", 0.0)
    host.run("alice", True)
    host.run("bob", True)
    host.tick(0.0)
    host.claim("carol", 1.0)
    host.tick(1.0)
    assert host.leases["carol"].state == LeaseState.PENDING
    return host


def test_a_kernel_said_to_run_a_cell_is_not_taken_while_an_idle_one_will_serve_soon():
    host = the_bad_run()
    # bob's cell runs on, but from t=2 the host no longer counts his server's word (no evidence);
    # alice's cell ends at t=6.
    host.running = {"k-bob"}
    host.run("bob", False)
    host.tick(2.0)
    host.run("alice", False)
    result = host.tick(6.0)
    assert not host.reclaimed(result)
    # At t=7 bob has counted idle for 5 s, alice for 1 s: bob's lease is not taken; the pass
    # wakes when alice's is past the contended threshold.
    result = host.tick(7.0)
    assert not host.reclaimed(result), [d.reason for d in result.decisions]
    assert result.next_wakeup == 8.0
    result = host.tick(8.0)
    assert host.reclaimed(result) == ["alice"]
    assert host.leases["bob"].state != LeaseState.RECLAIMING


def test_between_two_idle_leases_the_one_said_to_run_a_cell_goes_last():
    host = the_bad_run()
    host.running = {"k-bob"}
    host.run("bob", False)
    host.tick(2.0)
    host.run("alice", False)
    host.tick(3.0)
    # Both are past the threshold, bob idle for longer: alice's is taken.
    result = host.tick(9.0)
    assert host.reclaimed(result) == ["alice"]


def test_the_word_alone_does_not_keep_a_gpu_for_ever():
    host = the_bad_run()
    host.running = {"k-alice", "k-bob"}  # both servers say so, neither with evidence
    host.run("alice", False)
    host.run("bob", False)
    result = host.tick(2.0)
    assert not host.reclaimed(result)
    result = host.tick(4.0)
    assert len(host.reclaimed(result)) == 1, "with no idle kernel to take, one said to run is taken"
    taken = next(d for d in result.decisions if d.kind in ("reclaim", "notice"))
    assert "its server says it runs a cell" in taken.reason


def test_without_the_word_the_longest_idle_lease_goes_first_as_before():
    host = the_bad_run()
    host.run("bob", False)
    host.tick(2.0)
    host.run("alice", False)
    result = host.tick(7.0)
    assert host.reclaimed(result) == ["bob"]


PROFILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROFILE
@given(
    kernels=st.lists(
        st.tuples(st.floats(0.0, 20.0), st.booleans()),  # (seconds since it last ran, said to run a cell)
        min_size=1, max_size=4,
    ),
    claims=st.integers(1, 2),
)
def test_a_kernel_said_to_run_is_never_taken_over_an_otherwise_equal_idle_one(kernels, claims):
    """Every lease is borrowed (quota 0.5), alike but for idle time and the host's word; every
    claim waits. Whenever a lease said to run a cell is taken, no idle lease that is not said to
    run one is left untaken, past its threshold or about to be."""
    n = len(kernels)
    host = Host(gpus(n))
    for i in range(n):
        host.claim(f"h{i}", 0.0)
        host.run(f"h{i}", True)
    host.tick(0.0)
    now = 100.0
    # Each kernel last ran at now - quiet_for, and has been idle since.
    for i, (quiet_for, said) in enumerate(kernels):
        lease = host.leases[f"h{i}"]
        host.leases[lease.id] = replace(lease, busy=False, last_active_at=now - quiet_for)
        host.run(f"h{i}", False)
        if said:
            host.running.add(f"k-h{i}")
    for c in range(claims):
        host.claim(f"w{c}", now - 30.0)
    result = host.tick(now)
    taken = set(host.reclaimed(result))
    said_taken = {i for i, (_, said) in enumerate(kernels) if said and f"h{i}" in taken}
    if said_taken:
        left = [i for i, (_, said) in enumerate(kernels) if not said and f"h{i}" not in taken]
        assert not left, (kernels, taken)



def test_a_servers_word_does_not_lift_a_borrowed_lease_above_the_fair_order():
    """mallory holds two GPUs, one beyond her guaranteed share, and her server says both kernels
    run cells, for ever, with nothing to show for it. carol holds her one guaranteed GPU, idle,
    and her second kernel waits. mallory's borrowed lease goes first: the server's word decides
    only between candidates of the same standing, it does not lift a lease above the fair order."""
    cfg = replace(CFG, quotas={"*": 1}, usage_half_life=3600.0)
    devices = gpus(3)
    leases = {}
    for lease_id, user, t in (("m1", "mallory", 0.0), ("m2", "mallory", 0.0), ("c1", "carol", 0.0)):
        lease = new_claim(lease_id, f"k-{lease_id}", user, t)
        admit(lease, devices, leases.values(), cfg)
        leases[lease_id] = lease
    busy = {k: KernelActivity(k, busy=True, last_busy_at=None, gpu_memory=GiB) for k in ("k-m1", "k-m2", "k-c1")}

    def tick(now, activity, running=frozenset()):
        result = plan(devices, leases.values(), activity, now, cfg, CHECKPOINT, usage={"user:mallory": 7200.0},
                      running=running)
        leases.update({le.id: le for le in result.leases})
        return result

    tick(0.0, busy)
    assert all(le.holding for le in leases.values())
    waiting = new_claim("c2", "k-c2", "carol", 1.0)
    admit(waiting, devices, leases.values(), cfg)
    leases["c2"] = waiting
    idle = {k: replace(a, busy=False) for k, a in busy.items()}
    said = frozenset({"k-m1", "k-m2"})
    taken = set()
    for now in (1.0, 5.0, 7.0, 9.0, 11.0):
        result = tick(now, idle, said)
        taken |= {d.lease.id for d in result.decisions if d.kind in ("reclaim", "notice")}
    assert taken & {"m1", "m2"}, f"a borrowed lease of mallory's was taken: {taken}"
    assert "c1" not in taken, "carol's guaranteed GPU was not taken for her own claim before mallory's borrowed one"
