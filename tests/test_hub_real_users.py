"""Hub mode on a host with real Unix accounts: JupyterHub's default spawner runs each user's server
and kernels as that user, from an environment an admin installed for everyone, as on a shared GPU
server. The broker runs as root, as a hub-managed service, on 2 simulated GPUs.

What a hostile local user may try here is tried by a real process under her own uid.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import textwrap
import threading
import time

import psutil
import pytest

from hub_util import (
    SYSTEM_PYTHON, Hub, Kernel, real_users_unavailable, start_kernel, unix_users, users_environment,
)
from test_hub import (
    VISIBLE, admin_status, assert_ledger_sound, forged_connection, lease_of, server_of, until, visible,
)

pytestmark = [
    pytest.mark.hub,
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(real_users_unavailable() is not None, reason=real_users_unavailable() or ""),
]

USERS = ("alice", "bob", "carol")
#: The timings of a reported bad run: a kernel counts idle 3 s after its last cell, and a borrowed
#: GPU goes to whoever waits 2 s after that.
BROKER = {
    "idle_timeout": 3.0,
    "contended_idle_timeout": 2.0,
    "release_timeout": 3600.0,
    "grace_period": 2.0,
    "quotas": {"*": 0.5},
    "show_holders": False,
    # A server stopped for a few seconds (below) is not yet taken for gone.
    "heartbeat_timeout": 20.0,
}
#: How many times the scenario of the wrong kernel's checkpoint runs (each about 40 s).
SCENARIO_RUNS = int(os.environ.get("GPUSCHED_SCENARIO_RUNS", "2"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    unix_users(USERS)
    env = users_environment()
    h = Hub(tmp_path_factory.mktemp("hub-users"), broker=BROKER, admins=("admin",), users_env=env)
    h.add_kernelspec("gpu")
    with h:
        h.create_users(["admin", *USERS])
        h.start_servers(USERS)
        h.kernels = {}
        yield h
        for kernel in h.kernels.values():
            kernel.close()


def as_user(name: str):
    entry = pwd.getpwnam(name)

    def demote():
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)

    return demote


# -- servers and kernels as their users -----------------------------------------------------------
def test_each_users_server_and_kernel_run_as_that_user(hub):
    for user in USERS:
        server = server_of(hub, user)
        assert psutil.Process(server["pid"]).username() == user
    kb = hub.kernels["bob"] = start_kernel(hub, "bob")
    out = kb.execute("import os; print('UID', os.getuid())\n" + VISIBLE)
    assert f"UID {pwd.getpwnam('bob').pw_uid}" in out["stdout"], out
    assert visible(out), "bob's first cell got a GPU through the broker"
    # The ledger is the broker's alone: bob's kernel cannot read it.
    out = kb.execute(f"open({hub.ledger_path!r}, 'rb').read(16)")
    assert "PermissionError" in json.dumps(out), out
    # The admin page names the lease's user.
    code, page = hub.call("GET", hub.broker_url, hub.token("admin"))
    assert code == 200 and "bob" in json.dumps(page)


# -- the broker's address cannot be taken ---------------------------------------------------------
SQUATTER = textwrap.dedent(
    """
    import json, os, socket, sys, time
    sock_path, port, out, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    tried = {}
    for name, attempt in (("bind", None), ("unlink", os.unlink)):
        try:
            if attempt is None:
                s = socket.socket(socket.AF_UNIX)
                s.bind(sock_path)
            else:
                attempt(sock_path)
            tried[name] = "done"
        except OSError as e:
            tried[name] = e.strerror
    received, listening = [], False
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as any server does
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not listening:
            try:
                tcp.bind(("127.0.0.1", port))
                tcp.listen(64)
                tcp.settimeout(0.1)
                listening = True
            except OSError:
                time.sleep(0.02)
                continue
        try:
            conn, _ = tcp.accept()
        except socket.timeout:
            continue
        conn.settimeout(1)
        try:
            received.append(conn.recv(65536).decode("latin-1"))
        except OSError:
            received.append("")
        conn.close()
    with open(out, "w") as f:
        json.dump({"tried": tried, "listening": listening, "received": received}, f)
    """
)


def test_no_token_reaches_a_user_who_takes_the_brokers_address_while_it_restarts(hub):
    tokens = {user: psutil.Process(server_of(hub, user)["pid"]).environ()["JUPYTERHUB_API_TOKEN"] for user in USERS}
    out = os.path.join(pwd.getpwnam("alice").pw_dir, "squat.json")
    if os.path.exists(out):
        os.unlink(out)
    old = hub.broker_process()
    assert old is not None
    # The broker stops (an upgrade, a crash); alice is ready and takes what she can.
    squatter = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", SQUATTER, hub.broker_socket, str(hub.broker_port), out, "12"],
        preexec_fn=as_user("alice"), cwd="/",
    )
    old.send_signal(signal.SIGTERM)
    assert squatter.wait(60) == 0
    with open(out) as f:
        seen = json.load(f)
    assert seen["tried"]["bind"] in ("Permission denied", "Address already in use"), seen["tried"]
    assert seen["tried"]["unlink"] in ("Permission denied", "No such file or directory"), seen["tried"]
    # She held the broker's TCP port (it was free for a moment), and no server sent her anything.
    assert seen["listening"], "alice got the broker's TCP port while it was down"
    assert not any(token in data for token in tokens.values() for data in seen["received"])
    assert seen["received"] == [], f"connections reached alice's listener: {seen['received'][:3]}"

    # The hub starts the broker again; every server reconnects on its own.
    def restarted():
        proc = hub.broker_process()
        return proc if proc is not None and proc.pid != old.pid else None

    until(restarted, 90, "the hub to restart the broker", hub)
    hub.wait_broker(90)

    def all_connected():
        servers = admin_status(hub)["servers"]
        return all(any(s["user"] == u and s["connected"] for s in servers) for u in USERS)

    until(all_connected, 90, "every server to reconnect by itself", hub)
    kb = hub.kernels["bob"]
    assert visible(kb.execute(VISIBLE)), "bob's kernel still has its GPU"
    assert_ledger_sound(hub)


# -- kernel ids stay their owners' across a restart -----------------------------------------------
def _restart_broker(hub: Hub) -> None:
    old = hub.broker_process()
    assert old is not None
    old.send_signal(signal.SIGTERM)

    def restarted():
        proc = hub.broker_process()
        return proc if proc is not None and proc.pid != old.pid else None

    until(restarted, 90, "the hub to restart the broker", hub)
    hub.wait_broker(90)


def test_after_a_restart_another_users_server_cannot_take_a_kernel_id(hub):
    """alice knows bob's kernel id. The broker restarts, and her server speaks first: it reports
    bob's kernel as hers, then leaves it out. bob keeps his kernel and its lease."""
    kb = hub.kernels["bob"]
    # bob's kernel holds GPU memory: its lease is not given up while it idles.
    out = kb.execute("from jupyter_gpusched.devices import simulated\nsimulated.allocate('1GiB')\n" + VISIBLE)
    assert out["error"] is None and visible(out), out
    lease = lease_of(hub, "bob", kb.id)
    assert lease is not None
    bob_server = psutil.Process(server_of(hub, "bob")["pid"])
    alice_server = server_of(hub, "alice")
    alice_token = psutil.Process(alice_server["pid"]).environ()["JUPYTERHUB_API_TOKEN"]
    bob_server.suspend()  # so that alice's report surely comes first
    try:
        _restart_broker(hub)
        ws = forged_connection(hub, alice_token, [
            "X-GPUSched-Server: alice-second", f"X-GPUSched-Pid: {alice_server['pid']}",
        ])
        assert ws, "alice's own server process with its own token may connect"
        ws.send(json.dumps({"type": "heartbeat", "kernels": {kb.id: {"busy": False, "pid": alice_server["pid"]}}}))
        answer = json.loads(ws.recv())
        assert answer["type"] == "error" and "another user" in answer["message"], answer
        ws.send(json.dumps({"type": "heartbeat", "kernels": {}}))  # and now it is gone, she says
        time.sleep(2.0)
        ws.close()
    finally:
        bob_server.resume()

    def bob_back():
        servers = admin_status(hub)["servers"]
        return any(s["user"] == "bob" and s["connected"] and kb.id in s["kernels"] for s in servers)

    until(bob_back, 60, "bob's server to reconnect with his kernel", hub)
    again = lease_of(hub, "bob", kb.id)
    assert again is not None and again["id"] == lease["id"] and again["state"] in ("active", "idle"), again
    assert visible(kb.execute(VISIBLE)) == lease["devices"][0], "bob's kernel still holds its GPU"
    code, mine = hub.server("bob", "GET", "api/gpusched/leases")
    assert code == 200 and [le["id"] for le in mine if le["state"] != "released"] == [lease["id"]]
    assert_ledger_sound(hub)


# -- the idle kernel is the one taken, never a running one ----------------------------------------
def _cell(seconds: float) -> str:
    return textwrap.dedent(f"""
        import time
        from jupyter_gpusched.devices import simulated
        if simulated.memory_allocated() == 0:
            simulated.allocate('1GiB')
        end = time.time() + {seconds}
        while time.time() < end:
            simulated.set_utilization(90)
            time.sleep(0.5)
        simulated.set_utilization(0)
        print('HELD', simulated.memory_allocated())
    """)


class Watch(threading.Thread):
    """Samples the broker's view every few tenths of a second, as an admin's page would."""

    def __init__(self, hub: Hub, kernels: dict[str, Kernel]) -> None:
        super().__init__(daemon=True)
        self.hub, self.kernels = hub, kernels
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.states: dict[str, set[str]] = {u: set() for u in kernels}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                status = admin_status(self.hub)
            except Exception:  # noqa: BLE001 - the next sample may work
                continue
            leases = {le["kernel_id"]: le for le in status["leases"] if le["state"] != "released"}
            for user, kernel in self.kernels.items():
                lease = leases.get(kernel.id)
                if lease is not None:
                    self.states[user].add(lease["state"])
            for device in status["devices"]:
                holders = {p.get("kernel_id") for p in device.get("processes", []) if p.get("kernel_id")}
                if len(holders) > 1:
                    self.problems.append(f"GPU {device['index']} holds the processes of {len(holders)} kernels")
            time.sleep(0.3)


@pytest.mark.parametrize("run", range(SCENARIO_RUNS))
def test_the_idle_kernel_is_checkpointed_not_the_one_running_a_cell(hub, run):
    for kernel in hub.kernels.values():
        hub.server(kernel.user, "DELETE", f"api/kernels/{kernel.id}")
        kernel.close()
    hub.kernels = {}
    until(lambda: not [le for le in admin_status(hub)["leases"] if le["state"] != "released"], 60,
          "the last run's leases to end", hub)
    until(lambda: all(any(s["user"] == u and s["connected"] for s in admin_status(hub)["servers"]) for u in USERS),
          90, "every server to be connected", hub)
    ka = hub.kernels["alice"] = start_kernel(hub, "alice")
    kb = hub.kernels["bob"] = start_kernel(hub, "bob")
    kc = hub.kernels["carol"] = start_kernel(hub, "carol")
    watch = Watch(hub, {"alice": ka, "bob": kb})
    watch.start()
    try:
        a = ka.submit(_cell(6))
        b = kb.submit(_cell(25))
        until(lambda: lease_of(hub, "alice", ka.id) and lease_of(hub, "bob", kb.id), 60, "both GPUs held", hub)
        time.sleep(1.0)
        c = kc.submit(VISIBLE)  # carol's first cell waits for a GPU
        out_a = ka.result(a, 60)
        assert "HELD 1073741824" in out_a["stdout"], out_a
        out_c = kc.result(c, 90)
        assert visible(out_c), out_c
        alice_lease = lease_of(hub, "alice", ka.id)
        assert alice_lease is not None and alice_lease["state"] == "suspended", (alice_lease, watch.states)
        out_b = kb.result(b, 90)
        assert "HELD 1073741824" in out_b["stdout"] and not out_b.get("error"), out_b
        assert "suspended" not in watch.states["bob"] and "reclaiming" not in watch.states["bob"], watch.states
        # alice comes back: her next cell waits for a GPU, and finds her 1 GiB where she left it.
        out_a2 = ka.execute("from jupyter_gpusched.devices import simulated; print('HELD', simulated.memory_allocated())", 120)
        assert "HELD 1073741824" in out_a2["stdout"], out_a2
        for user, kernel in (("alice", ka), ("bob", kb)):
            assert lease_of(hub, user, kernel.id) is not None, f"{user}'s live kernel kept a lease"
    finally:
        watch.stop.set()
        watch.join(5)
    assert watch.problems == []
    assert_ledger_sound(hub)
