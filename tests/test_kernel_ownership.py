"""A kernel id stays its user's (and its server's): after a broker restart the ledger says whose
each kernel is, so another user's server that reports it first takes nothing, and a server that
reports a kernel it does not own never ends the owner's lease.

``test_hub_broker.py`` runs the same story through the broker's API and websockets.
"""

from __future__ import annotations

import logging

import pytest

from jupyter_gpusched.hub.remote import ENDED_MEMORY, RemoteKernels

from test_hub_units import Clock, Conn, beat, connect, servers  # noqa: F401 - servers is a fixture


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def kernels(clock):
    return RemoteKernels("broker", heartbeat_timeout=10, launch_grace=60, clock=clock)


def test_after_a_restart_another_users_server_cannot_take_a_kernel_the_ledger_records(kernels, servers, caplog):
    """Alice's server reports bob's kernel id first after the restart, then drops it: bob keeps it."""
    # The broker restarted: its ledger says bob's lease is for kernel kb (and k-old was bob's too).
    leases = {"kb": "bob"}
    kernels.lease_user = leases.get
    kernels.remember_users({"kb": "bob", "k-old": "bob"})
    a, b = servers(), servers()
    connect(kernels, "sa", "alice", pid=a.pid)
    connect(kernels, "sb", "bob", pid=b.pid)
    with caplog.at_level(logging.WARNING, "jupyter_gpusched.broker"):
        problems = beat(kernels, "sa", kb={"busy": True, "pid": a.kernel_pid}, **{"k-old": {}})
    assert problems == ["kernel kb belongs to another user", "kernel k-old belongs to another user"]
    assert "server sa of alice reported kernel kb, which is bob's; ignored" in caplog.text
    assert kernels.user_of("kb") == "bob" and kernels.user_of("k-old") == "bob"
    assert kernels.alive("kb") is None, "not reported by its own server yet: unknown, not gone"
    assert beat(kernels, "sa") == [], "alice's server drops it"
    assert kernels.alive("kb") is None, "alice's heartbeats never end bob's kernel"

    # Bob's server is believed as ever, and bob may claim.
    assert beat(kernels, "sb", kb={"pid": b.kernel_pid}) == []
    assert kernels.alive("kb") is True and kernels.kernel_pid("kb") == b.kernel_pid
    kernels.register("kb", "bob", "sb")
    with pytest.raises(PermissionError):
        kernels.register("kb", "alice", "sa")
    assert beat(kernels, "sa", kb={}) == ["kernel kb belongs to another user"]
    beat(kernels, "sa")
    assert kernels.alive("kb") is True, "alice's server reporting it again and dropping it ends nothing"
    assert kernels.servers()[0]["kernels"] == [] and kernels.servers()[1]["kernels"] == ["kb"]


def test_the_ledgers_record_of_a_kernel_is_forgotten_after_a_while(kernels, clock):
    kernels.remember_users({"kb": "bob"})
    connect(kernels, "sa", "alice")
    clock.now += ENDED_MEMORY + 1
    kernels.prune()
    assert kernels.user_of("kb") is None
    connect(kernels, "sa", "alice")
    assert beat(kernels, "sa", kb={}) == []


def test_a_live_lease_keeps_its_kernel_with_its_user_whatever_the_memory(kernels, clock):
    leases = {"kb": "bob"}
    kernels.lease_user = leases.get
    clock.now += 10 * ENDED_MEMORY
    kernels.prune()
    connect(kernels, "sa", "alice")
    assert beat(kernels, "sa", kb={}) == ["kernel kb belongs to another user"]
    assert kernels.user_of("kb") == "bob"


def test_another_server_of_the_same_user_cannot_take_a_kernel_its_server_still_has(kernels, servers, caplog):
    one, two = servers(), servers()
    connect(kernels, "s1", "bob", pid=one.pid)
    connect(kernels, "s2", "bob", pid=two.pid)
    assert beat(kernels, "s1", k1={"pid": one.kernel_pid}) == []
    with caplog.at_level(logging.WARNING, "jupyter_gpusched.broker"):
        assert beat(kernels, "s2", k1={}) == ["kernel k1 is another server's (server s1)"]
    assert "server s2 of bob reported kernel k1 of its server s1, which still runs; ignored" in caplog.text
    beat(kernels, "s2")
    assert kernels.alive("k1") is True and kernels.kernel_pid("k1") == one.kernel_pid
    # A server whose process is gone gives its kernels up.
    kernels.disconnect("s1", kernels.connection("s1"))
    one.close()
    assert beat(kernels, "s2", k1={}) == []
    assert kernels.servers()[1]["kernels"] == ["k1"]
