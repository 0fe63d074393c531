"""The broker's registry of servers and kernels, its heartbeat reader and its admin views, each
on its own: plain objects, no processes (the process checks are in test_hub_units.py and
test_pid_namespaces.py)."""

from __future__ import annotations

import pytest

from jupyter_gpusched.hub import admin
from jupyter_gpusched.hub.heartbeat import HeartbeatError, check_kernels
from jupyter_gpusched.hub.registry import ENDED_MEMORY, OnceLog, Registry, TooMany


class Conn:
    async def order(self, action: str, kernel_id: str) -> None:  # pragma: no cover - not ordered here
        raise AssertionError("no orders in these tests")


def _connected(registry: Registry, server_id: str, user: str, now: float = 0.0):
    server = registry.open_server(server_id, user, now, max_servers_per_user=2)
    server.connection = Conn()
    server.last_seen = now
    return server


def test_a_kernel_id_never_passes_to_another_user():
    registry = Registry()
    alice = _connected(registry, "s-alice", "alice")
    bob = _connected(registry, "s-bob", "bob")
    warned = []
    kernel, problem = registry.take("k1", alice, 0.0, lambda *a: warned.append(a))
    assert kernel is not None and problem is None and kernel.user == "alice"
    kernel.reported = True
    taken, problem = registry.take("k1", bob, 1.0, lambda *a: warned.append(a))
    assert taken is None and problem == "kernel k1 belongs to another user"
    assert registry.kernels["k1"].server_id == "s-alice" and "k1" in alice.kernels and not bob.kernels
    assert len(warned) == 1
    with pytest.raises(PermissionError):
        registry.register("k1", "bob", "s-bob", 2.0)


def test_a_kernel_another_server_of_the_user_still_has_is_refused():
    registry = Registry()
    first = _connected(registry, "s1", "alice")
    second = _connected(registry, "s2", "alice")
    kernel, _ = registry.take("k1", first, 0.0, lambda *a: None)
    kernel.reported = True
    taken, problem = registry.take("k1", second, 1.0, lambda *a: None)
    assert taken is None and problem == "kernel k1 is another server's (server s1)"
    # Once the first server no longer has it, the second one may take it.
    del first.kernels["k1"]
    taken, problem = registry.take("k1", second, 2.0, lambda *a: None)
    assert taken is kernel and problem is None and kernel.server_id == "s2" and "k1" in second.kernels


def test_whose_a_kernel_is_lease_then_ledger_then_reporter_then_memory():
    registry = Registry()
    server = _connected(registry, "s1", "alice")
    registry.remember_users({"k-recorded": "carol"}, now=0.0)
    registry.take("k-seen", server, 0.0, lambda *a: None)
    assert registry.user_of("k-recorded") == "carol"
    assert registry.user_of("k-seen") == "alice"
    assert registry.user_of("k-unknown") is None
    registry.lease_user = {"k-recorded": "dave"}.get
    assert registry.user_of("k-recorded") == "dave", "the live lease's user comes first"
    registry.lease_user = lambda kernel_id: None
    assert registry.forget("k-seen", now=10.0).user == "alice"
    assert "k-seen" not in registry.kernels and not server.kernels
    assert registry.user_of("k-seen") == "alice", "an ended kernel is remembered"
    registry.expire(now=10.0 + ENDED_MEMORY)
    assert registry.user_of("k-seen") == "alice" and registry.user_of("k-recorded") is None
    registry.expire(now=10.0 + ENDED_MEMORY + 1)
    assert registry.user_of("k-seen") is None


def test_servers_per_user_are_bounded_and_ids_are_not_shared():
    registry = Registry()
    _connected(registry, "s1", "alice")
    _connected(registry, "s2", "alice")
    with pytest.raises(TooMany, match="alice has 2 servers connected"):
        registry.open_server("s3", "alice", 0.0, max_servers_per_user=2)
    with pytest.raises(PermissionError, match="server id s1 belongs to another user"):
        registry.open_server("s1", "bob", 0.0, max_servers_per_user=2)
    assert set(registry.servers) == {"s1", "s2"}


def test_a_registered_kernel_is_undone_only_until_its_server_reports_it():
    registry = Registry()
    registry.register("k1", "alice", "s1", 0.0)
    registry.unregister("k1")
    assert "k1" not in registry.kernels and not registry.servers["s1"].kernels
    registry.register("k2", "alice", "s1", 0.0)
    registry.kernels["k2"].reported = True
    registry.unregister("k2")
    assert "k2" in registry.kernels
    with pytest.raises(ValueError):
        registry.register("k/3", "alice", "s1", 0.0)


def test_a_heartbeat_must_be_an_object_of_bounded_size():
    assert check_kernels({"k1": {}}, 1) == {"k1": {}}
    with pytest.raises(HeartbeatError, match="kernels must be an object"):
        check_kernels(["k1"], 1)
    with pytest.raises(HeartbeatError, match="at most 1 kernels"):
        check_kernels({"k1": {}, "k2": {}}, 1)


def test_the_admin_sees_each_server_silent_or_connected_and_its_pod():
    registry = Registry()
    here = _connected(registry, "s1", "alice", now=100.0)
    pod = _connected(registry, "s2", "bob", now=90.0)
    pod.pid_ns, pod.hostname = 4026532000, "jupyter-bob"
    here.hostname = "not-a-pod"
    registry.take("k1", here, 100.0, lambda *a: None)
    view = admin.servers(registry, now=105.0, heartbeat_timeout=10.0)
    assert [(s["server_id"], s["connected"], s["silent_seconds"], s["pod"], s["kernels"]) for s in view] == [
        ("s1", True, 5.0, None, ["k1"]),
        ("s2", False, 15.0, "jupyter-bob", []),
    ]
    assert admin.connected_servers(registry, now=105.0, heartbeat_timeout=10.0) == [frozenset({"k1"})]


def test_a_warning_is_logged_once_per_key(caplog):
    once = OnceLog()
    for _ in range(3):
        once.warn("k", "server %s said %s", "s1", "something odd")
    assert [r.getMessage() for r in caplog.records] == ["server s1 said something odd"]
    assert once.first("x") and not once.first("x")
