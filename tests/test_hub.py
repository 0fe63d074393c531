"""Hub mode end to end: a real JupyterHub, configurable-http-proxy, the GPU broker as a managed
service, and the users' own single-user servers (dummy authenticator, local process spawner) on
2 simulated GPUs.

The hub loads ``examples/jupyterhub_config.py`` as written (plus test-only settings: ports,
scratch files, dummy login, simulated GPUs). Kernels are real ipykernel processes started through
gpusched-provisioner on each user's server; they bind lazily, at their first cell, through their
server, which asks the broker. Times are real but short (idle after 5 s, borrowed GPUs taken back
after 1 s more), so no test waits long. The tests of this module run in order on one hub.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import requests

from jupyter_gpusched.ledger import Ledger

from hub_util import EXAMPLE, Hub, Kernel, start_kernel

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(900)]

VISIBLE = "import os; print('VISIBLE=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''))"
BROKER = {
    "idle_timeout": 5.0,
    "contended_idle_timeout": 1.0,
    "release_timeout": 3600.0,
    "grace_period": 2.0,
    "quotas": {"group:staff": 1, "*": 0.5},
    "max_pending_per_user": 3,
}


def visible(out: dict) -> str:
    for line in out["stdout"].splitlines():
        if line.startswith("VISIBLE="):
            return line.split("=", 1)[1]
    raise AssertionError(f"the cell printed no CUDA_VISIBLE_DEVICES: {out}")


def until(predicate, timeout: float = 60.0, what: str = "a condition", hub: Hub | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (_diagnose(hub) if hub else ""))
        time.sleep(0.25)


def _diagnose(hub: Hub) -> str:
    """The broker's view and the end of the hub's log, for a failure message."""
    try:
        code, status = hub.broker("GET", "status", hub.token("admin"))
        leases = [
            (le["user"], (le["kernel_id"] or "")[:8], le["state"], le["device_indices"], le["reason"])
            for le in status.get("leases", [])
        ]
        view = f"leases {leases}\nqueue {status.get('queue')}"
    except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the failure
        view = f"(no broker status: {exc})"
    return f"\n{view}\n{hub.log_tail(60)}"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if not EXAMPLE.exists():
        pytest.skip("examples/jupyterhub_config.py is not in this checkout")
    h = Hub(tmp_path_factory.mktemp("hub"), broker=BROKER, admins=("admin",))
    h.add_kernelspec("gpu")
    h.kernels = {}
    with h:
        h.create_users(["alice", "bob", "carol", "mallory"])
        h.add_to_group("staff", ["bob"])
        h.start_servers(["alice", "bob", "carol", "admin", "mallory"])
        yield h
        for kernel in h.kernels.values():
            kernel.close()


def leases_of(hub: Hub, user: str, kernel_id: str) -> list[dict]:
    code, leases = hub.server(user, "GET", f"api/gpusched/leases?kernel_id={kernel_id}")
    assert code == 200, leases
    return [le for le in leases if le["state"] != "released"]


def lease_of(hub: Hub, user: str, kernel_id: str) -> dict | None:
    live = leases_of(hub, user, kernel_id)
    assert len(live) <= 1, live
    return live[0] if live else None


def seen_busy(hub: Hub, user: str, kernel_id: str) -> bool:
    """The broker counts the kernel as running now: its lease, active since some cell ran, has
    been idle for no time at all."""
    lease = lease_of(hub, user, kernel_id) or {}
    return lease.get("last_active_at") is not None and lease.get("idle_seconds") == 0


def admin_status(hub: Hub) -> dict:
    code, status = hub.broker("GET", "status", hub.token("admin"))
    assert code == 200, status
    return status


def events_socket(hub: Hub, user: str):
    """The events websocket of a user's server, as JupyterLab opens it."""
    import websocket as wsclient

    url = hub.server_url(user).replace("http://", "ws://") + "api/gpusched/events"
    return wsclient.create_connection(url, header=[f"Authorization: token {hub.token(user)}"], timeout=30)


def read_events(ws, seconds: float) -> list[dict]:
    import websocket as wsclient

    out = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ws.settimeout(left)
        try:
            out.append(json.loads(ws.recv()))
        except wsclient.WebSocketTimeoutException:
            break
    return out


def server_of(hub: Hub, user: str) -> dict:
    """The user's single-user server as the broker lists it (id, process id)."""
    return until(
        lambda: next((s for s in admin_status(hub)["servers"] if s["user"] == user and s["connected"]), None),
        60, f"{user}'s server to connect", hub,
    )


def server_token(hub: Hub, user: str) -> str:
    """The API token the hub gave the user's server: the user can read it in her own server."""
    return psutil.Process(server_of(hub, user)["pid"]).environ()["JUPYTERHUB_API_TOKEN"]


def forged_connection(hub: Hub, token: str, headers: list[str]):
    """A hand-made server connection to the broker; None if the broker refuses it."""
    import websocket as wsclient

    url = hub.broker_url.replace("http://", "ws://") + "api/gpusched/servers/connect"
    try:
        ws = wsclient.create_connection(url, header=[f"Authorization: token {token}", *headers], timeout=10)
        first = json.loads(ws.recv())
    except (wsclient.WebSocketException, ConnectionError, ValueError):
        return None
    if first.get("type") != "welcome":
        ws.close()
        return None
    return ws


def ledger_problems(hub: Hub) -> list[str]:
    with Ledger(hub.ledger_path) as ledger:
        return ledger.check()


def assert_ledger_sound(hub: Hub, timeout: float = 15.0) -> None:
    """The ledger's own audit finds nothing, once in-flight changes settle (a restarted kernel's
    new process becomes its lease's owner at the broker's next pass after the heartbeat)."""
    deadline = time.monotonic() + timeout
    while (problems := ledger_problems(hub)) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert problems == []


# -- the users' servers ---------------------------------------------------------------------------
def test_a_users_server_is_in_hub_mode_and_answers_for_its_user(hub):
    code, status = hub.server("alice", "GET", "api/gpusched/status")
    assert code == 200, status
    assert status["mode"] == "hub" and status["user"] == "alice" and status["is_admin"] is False
    assert len(status["devices"]) == 2 and status["backend"] == "simulated"
    code, status = hub.server("admin", "GET", "api/gpusched/status")
    assert code == 200 and status["is_admin"] is True and status["user"] == "admin"
    # The server's own REST API is the standalone one: the OpenAPI document is served too.
    code, doc = hub.server("bob", "GET", "api/gpusched/openapi.json")
    assert code == 200 and "paths" in doc


# -- sharing, the queue, reclaim and quotas -----------------------------------------------------
def test_users_share_two_gpus_through_the_broker(hub):
    """alice and bob get a GPU each; carol waits with her position; alice idles and is reclaimed
    (checkpointed, her state kept); carol is granted. Then quotas: bob, over his quota, waits
    while alice (under hers) is served first."""
    ka = hub.kernels["alice"] = start_kernel(hub, "alice")
    out = ka.execute(VISIBLE + "\nfrom jupyter_gpusched.devices import simulated\nsimulated.allocate('1GiB')")
    assert out["error"] is None, out
    gpu_a = visible(out)
    kb = hub.kernels["bob"] = start_kernel(hub, "bob")
    out = kb.execute(VISIBLE)
    gpu_b = visible(out)
    assert gpu_a and gpu_b and gpu_a != gpu_b
    lease_a = lease_of(hub, "alice", ka.id)
    lease_b = lease_of(hub, "bob", kb.id)
    assert lease_a["devices"] == [gpu_a] and lease_a["user"] == "alice" and lease_a["mine"]
    assert lease_b["devices"] == [gpu_b]

    # alice computes for a while, so that carol's claim has to wait.
    busy = ka.submit("import time; time.sleep(8)")
    until(lambda: seen_busy(hub, "alice", ka.id), 30, "the broker to see alice busy", hub)

    kc = hub.kernels["carol"] = start_kernel(hub, "carol")
    waiting = kc.submit(VISIBLE)
    pending = until(
        lambda: [le for le in leases_of(hub, "carol", kc.id) if le["state"] == "pending"], 30, "carol to queue", hub
    )
    assert pending[0]["position"] == 1
    code, status = hub.server("carol", "GET", "api/gpusched/status")
    assert [q["user"] for q in status["queue"]] == ["carol"] and status["queue"][0]["position"] == 1
    assert not kc.done(waiting), "carol's cell waits for its GPU"

    # alice's cell ends; her lease is borrowed (quota 0.5) and idle, so it goes to carol.
    ka.result(busy, 60)
    out = kc.result(waiting, 90)
    assert out["error"] is None, out
    assert visible(out) == gpu_a
    suspended = until(
        lambda: (lease_of(hub, "alice", ka.id) or {}).get("state") == "suspended", 30, "alice to be suspended", hub
    )
    assert suspended
    assert lease_of(hub, "bob", kb.id)["state"] in ("active", "idle"), "bob is within his quota: untouched"
    assert lease_of(hub, "carol", kc.id)["devices"] == [gpu_a]

    # Quotas. bob (group staff, quota 1) holds a GPU and keeps it pinned; carol (quota 0.5)
    # computes on hers. bob's second kernel asks: that would borrow, so it waits.
    code, kept = hub.server("bob", "POST", f"api/gpusched/leases/{lease_b['id']}/keep", {"seconds": 900})
    assert code == 200 and kept["keep_until"], kept
    kb2 = hub.kernels["bob2"] = start_kernel(hub, "bob")
    carol_busy = kc.submit("import time; time.sleep(12)")
    until(lambda: seen_busy(hub, "carol", kc.id), 30, "the broker to see carol busy", hub)
    bob_waits = kb2.submit(VISIBLE)
    until(lambda: [le for le in leases_of(hub, "bob", kb2.id) if le["state"] == "pending"], 30, "bob's 2nd claim", hub)
    # alice (quota 0.5, holding nothing now) asks after bob and goes ahead of him.
    alice_back = ka.submit(VISIBLE + "\nprint('HELD', simulated.memory_allocated())")

    def queue_users():
        return [q["user"] for q in admin_status(hub)["queue"]]

    until(lambda: queue_users() == ["alice", "bob"], 30, "alice ahead of bob in the queue", hub)
    assert not kc.done(carol_busy), "carol was still computing: nothing was taken from her yet"
    # carol's cell ends: her borrowed GPU is taken back and goes to alice (restored), not bob.
    kc.result(carol_busy, 60)
    out = ka.result(alice_back, 90)
    assert out["error"] is None, out
    assert "HELD 1073741824" in out["stdout"], "alice's GPU memory came back with the restore"
    assert lease_of(hub, "alice", ka.id)["state"] in ("active", "idle")
    assert not kb2.done(bob_waits)
    assert [le["state"] for le in leases_of(hub, "bob", kb2.id)] == ["pending"]
    assert lease_of(hub, "carol", kc.id) is None
    assert lease_of(hub, "bob", kb.id)["id"] == lease_b["id"]
    assert_ledger_sound(hub)

    # bob gives up on his second kernel: shutting it down withdraws the claim.
    code, _ = hub.server("bob", "DELETE", f"api/kernels/{kb2.id}")
    assert code == 204
    until(lambda: not leases_of(hub, "bob", kb2.id), 30, "bob's withdrawn claim", hub)
    hub.kernels.pop("bob2").close()


# -- security ---------------------------------------------------------------------------------
def test_a_user_can_neither_touch_nor_see_another_users_lease(hub):
    ka = hub.kernels["alice"]
    lease = lease_of(hub, "alice", ka.id)
    assert lease is not None and lease["state"] != "pending"
    bob = hub.token("bob")

    # Through the broker directly and through bob's own server: 403, and the lease is unchanged.
    for call in (
        lambda m, p, b=None: hub.broker(m, p, bob, b),
        lambda m, p, b=None: hub.server("bob", m, "api/gpusched/" + p, b),
    ):
        code, body = call("DELETE", f"leases/{lease['id']}")
        assert code == 403 and "another user" in body["message"], body
        code, body = call("POST", f"leases/{lease['id']}/keep", {"seconds": 600})
        assert code == 403, body
    # A forged kernel header does not make bob alice's kernel.
    code, body = hub.broker("DELETE", f"leases/{lease['id']}", bob, headers={"X-GPUSched-Kernel": ka.id})
    assert code == 403, body

    # bob sees the host, and alice's lease as "another user's", without her kernel id.
    code, leases = hub.server("bob", "GET", "api/gpusched/leases")
    theirs = [le for le in leases if le["id"] == lease["id"]]
    assert theirs and theirs[0]["user"] == "another user" and theirs[0]["kernel_id"] is None
    assert theirs[0]["notebook"] is None and theirs[0]["mine"] is False
    code, found = hub.server("bob", "GET", f"api/gpusched/leases?kernel_id={ka.id}")
    assert code == 200 and found == []
    code, one = hub.broker("GET", f"leases/{lease['id']}", bob)
    assert code == 200 and one["kernel_id"] is None and one["user"] == "another user"
    code, status = hub.broker("GET", "status", bob)
    text = json.dumps(status)
    assert ka.id not in text and "alice" not in text
    assert status["is_admin"] is False and "servers" not in status and status["unleased_processes"] == []
    # bob cannot claim for alice's kernel either.
    code, body = hub.server("bob", "POST", "api/gpusched/leases", {"kernel_id": ka.id})
    assert code == 404, body
    code, body = hub.broker("POST", "leases", bob, {"kernel_id": ka.id}, headers={"X-GPUSched-Server": "bobs-server"})
    assert code == 404, body

    # alice sees her own lease in full; a hub admin sees everyone's and may keep any lease.
    mine = lease_of(hub, "alice", ka.id)
    assert mine["kernel_id"] == ka.id and mine["user"] == "alice" and mine["mine"] is True
    admin = hub.token("admin")
    # The events websockets of both servers (what JupyterLab listens to) as the admin keeps it:
    # alice hears about her lease in full, bob only that another user's lease changed.
    alice_ws, bob_ws = events_socket(hub, "alice"), events_socket(hub, "bob")
    try:
        for ws in (alice_ws, bob_ws):
            snapshot = json.loads(ws.recv())
            assert snapshot["type"] == "snapshot" and snapshot["mode"] == "hub"
        assert ka.id not in json.dumps(snapshot), "bob's snapshot does not name alice's kernel"
        heard: dict[str, list[dict]] = {"alice": [], "bob": []}

        def kept_and_heard() -> bool:
            code, kept = hub.broker("POST", f"leases/{lease['id']}/keep", admin, {"seconds": 60})
            assert code == 200 and kept["keep_until"] and kept["kernel_id"] == ka.id
            for user, ws in (("alice", alice_ws), ("bob", bob_ws)):
                heard[user] += read_events(ws, 1.0)
            return any(e["type"] == "notice" and e["kind"] == "kept" for e in heard["alice"]) and any(
                e["type"] == "lease" and e["lease"]["id"] == lease["id"] for e in heard["bob"]
            )

        until(kept_and_heard, 30, "the servers' events", hub)
        notice = next(e for e in heard["alice"] if e["type"] == "notice" and e["kind"] == "kept")
        assert notice["kernel_id"] == ka.id
        assert not [e for e in heard["bob"] if e["type"] == "notice"], "notices are for their user only"
        theirs = [e["lease"] for e in heard["bob"] if e["type"] == "lease" and e["lease"]["id"] == lease["id"]]
        assert all(le["user"] == "another user" and le["kernel_id"] is None for le in theirs)
        assert ka.id not in json.dumps(heard["bob"])
    finally:
        alice_ws.close()
        bob_ws.close()
    assert lease_of(hub, "alice", ka.id)["state"] == mine["state"]


def test_hostile_callers_get_clear_errors_and_the_ledger_stays_consistent(hub):
    import websocket as wsclient

    before = {le["id"]: (le["state"], le["devices"]) for le in admin_status(hub)["leases"]}
    # No token, a forged token, a token in the wrong place.
    code, body = hub.broker("GET", "status", None)
    assert code == 403 and "token is required" in body["message"]
    code, body = hub.broker("GET", "status", "forged0123456789abcdef")
    assert code == 403 and "not valid" in body["message"]
    code, body = hub.broker("POST", "leases", None, {"kernel_id": "k"})
    assert code == 403
    code, body = hub.call("GET", hub.broker_url + "api/gpusched/status?token=" + hub.token("bob"))
    assert code == 403, "tokens in the URL are for websockets only"
    code, body = hub.call("GET", hub.broker_url + "nowhere", hub.token("bob"))
    assert code == 404
    ws_url = hub.broker_url.replace("http://", "ws://") + "api/gpusched/servers/connect"
    with pytest.raises(wsclient.WebSocketBadStatusException) as err:
        wsclient.create_connection(ws_url, header=["X-GPUSched-Server: fake"], timeout=10)
    assert err.value.status_code == 403

    # Malformed bodies, each with its own message (sent for mallory's own, connected server).
    mallory = hub.token("mallory")
    server = {"X-GPUSched-Server": server_of(hub, "mallory")["server_id"]}
    bad = [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({"kernel_id": "k1", "gpus": 1}), "unknown field"),
        (json.dumps({"kernel_id": ""}), "kernel_id"),
        (json.dumps({"kernel_id": "../../etc"}), "kernel_id"),
        (json.dumps({"kernel_id": "k1", "count": 0}), "count must be at least 1"),
        (json.dumps({"kernel_id": "k1", "count": "two"}), "count must be a whole number"),
        (json.dumps({"kernel_id": "k1", "count": 5}), "only 2"),
        (json.dumps({"kernel_id": "k1", "memory": "lots"}), "memory"),
        (json.dumps({"kernel_id": "k1", "memory": "900GiB"}), "largest GPU"),
        (json.dumps({"kernel_id": "k1", "mode": "greedy"}), "mode must be"),
        (json.dumps({"kernel_id": "k1", "wait": "forever"}), "wait"),
    ]
    for raw, words in bad:
        code, body = hub.call(
            "POST", hub.broker_url + "api/gpusched/leases", mallory, raw=raw,
            headers={**server, "Content-Type": "application/json"},
        )
        assert code == 400 and words in body["message"], (raw, code, body)
    code, body = hub.broker("POST", "leases", mallory, {"kernel_id": "k1", "priority": 100}, headers=server)
    assert code == 403 and "priority" in body["message"]
    code, body = hub.broker("POST", "leases/abc/keep", mallory, {})
    assert code == 400 and "seconds is required" in body["message"]
    code, body = hub.broker("POST", "leases/abc/keep", mallory, {"seconds": 5})
    assert code == 404
    uuid = admin_status(hub)["devices"][0]["uuid"]
    code, body = hub.broker("POST", f"devices/{uuid}/drain", mallory, {})
    assert code == 403 and "administrator" in body["message"]
    code, body = hub.broker("POST", "devices/GPU-nope/drain", hub.token("admin"), {})
    assert code == 404
    code, body = hub.broker("POST", f"kernels/{hub.kernels['alice'].id}/ended", mallory, {})
    assert code == 404, "mallory cannot end alice's kernel"

    # A hostile "server": it cannot connect without naming a process of its own (nor with another
    # user's server, nor with a made-up id), take over alice's kernel, or take alice's server id.
    mallory_server = server_of(hub, "mallory")
    alice_server = server_of(hub, "alice")
    for headers in (
        ["X-GPUSched-Server: mallorys-server"],
        ["X-GPUSched-Server: mallorys-server", f"X-GPUSched-Pid: {alice_server['pid']}"],
        ["X-GPUSched-Server: mallorys-server", f"X-GPUSched-Pid: {mallory_server['pid']}"],
        ["X-GPUSched-Server: mallorys-server", "X-GPUSched-Pid: 1"],
    ):
        assert not forged_connection(hub, mallory, headers), f"refused: {headers}"
    ws = forged_connection(hub, server_token(hub, "mallory"), [
        "X-GPUSched-Server: mallorys-server", f"X-GPUSched-Pid: {mallory_server['pid']}",
    ])
    assert ws, "her own server's process, with her server's own token: accepted"
    ws.send(json.dumps({"type": "heartbeat", "kernels": {hub.kernels["alice"].id: {"busy": True, "pid": 1}}}))
    assert "another user" in json.loads(ws.recv())["message"]
    ws.send("not json")
    assert json.loads(ws.recv())["type"] == "error"
    ws.close()
    assert not forged_connection(hub, server_token(hub, "mallory"), [
        f"X-GPUSched-Server: {alice_server['server_id']}", f"X-GPUSched-Pid: {mallory_server['pid']}",
    ]), "another user's server id is refused"
    assert any(s["server_id"] == alice_server["server_id"] and s["connected"] for s in admin_status(hub)["servers"])

    # A flood of claims from one user: the first few wait (or are granted), the rest are refused.
    results = []

    def claim(i: int) -> None:
        results.append(hub.broker("POST", "leases", mallory, {"kernel_id": f"flood-{i}"}, headers=server))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(25)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = sorted(code for code, _ in results)
    assert len(codes) == 25 and set(codes) <= {201, 202, 409}, results
    assert codes.count(202) <= 3
    refused = [body for code, body in results if code == 409]
    assert len(refused) >= 25 - 3 - 2 and all("claims waiting" in b["message"] for b in refused)
    # Nothing mallory sent changed anyone else's lease; the ledger is sound.
    after = {le["id"]: (le["state"], le["devices"]) for le in admin_status(hub)["leases"]}
    for lease_id, (state, _) in before.items():
        assert after.get(lease_id, (None,))[0] == state, (lease_id, before[lease_id], after.get(lease_id))
    assert_ledger_sound(hub)
    for code, body in results:
        if code in (201, 202):
            assert hub.broker("DELETE", f"leases/{body['id']}", mallory)[0] == 204
    assert not [le for le in admin_status(hub)["leases"] if le["kernel_id"] and le["kernel_id"].startswith("flood-")]
    assert_ledger_sound(hub)


# -- the admin page -----------------------------------------------------------------------------
def _login(hub: Hub, user: str) -> requests.Session:
    """A browser session: the hub's login form, then the OAuth dance to the broker's page."""
    session = requests.Session()
    r = session.get(hub.broker_url, timeout=30)
    assert r.url.startswith(hub.public_url + "hub/login"), r.url
    xsrf = session.cookies.get("_xsrf", path="/hub/")
    r = session.post(r.url, data={"username": user, "password": "x", "_xsrf": xsrf}, timeout=30)
    assert r.status_code == 200 and r.url.rstrip("/") == hub.broker_url.rstrip("/"), (r.status_code, r.url)
    return session


def _xsrf_of(page: str) -> str:
    marker = 'name="_xsrf" value="'
    start = page.index(marker) + len(marker)
    return page[start : page.index('"', start)]


def test_the_admin_page_shows_the_host_and_drains(hub):
    # A GPU process that belongs to no lease, as a user might start outside any kernel.
    uuid0 = admin_status(hub)["devices"][0]["uuid"]
    env = {**os.environ, "JUPYTER_GPUSCHED_SIM_STATE": hub.sim_state, "CUDA_VISIBLE_DEVICES": uuid0}
    stray = subprocess.Popen(
        [sys.executable, "-c", "from jupyter_gpusched.devices import simulated; import time; "
         "simulated.allocate('1GiB'); print('up', flush=True); time.sleep(120)"],
        env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert stray.stdout.readline().strip() == "up"
        status = until(
            lambda: (s := admin_status(hub)) and any(p["pid"] == stray.pid for p in s["unleased_processes"]) and s,
            30, "the stray GPU process to show", hub,
        )
        stray_entry = next(p for p in status["unleased_processes"] if p["pid"] == stray.pid)
        assert stray_entry["unix_user"] == __import__("getpass").getuser()

        admin = _login(hub, "admin")
        page = admin.get(hub.broker_url, timeout=30).text
        assert "GPUs of this host" in page and "(hub admin)" in page
        assert "alice" in page and "bob" in page and str(stray.pid) in page
        assert "GPU processes without a lease" in page and "Single-user servers" in page
        # Drain GPU 0 from the page: its button asks first, and the confirmation (a form with the
        # page's XSRF token) drains; then undrain it.
        assert admin.get(hub.broker_url, timeout=30).headers.get("X-Frame-Options") == "DENY"
        asked = admin.get(hub.broker_url + f"admin/devices/{uuid0}/drain", timeout=30)
        assert asked.status_code == 200 and "Drain GPU 0?" in asked.text
        assert next(d for d in admin_status(hub)["devices"] if d["uuid"] == uuid0)["health"] == "ok"
        r = admin.post(
            hub.broker_url + f"admin/devices/{uuid0}/drain", data={"_xsrf": _xsrf_of(asked.text), "confirm": "yes"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert next(d for d in admin_status(hub)["devices"] if d["uuid"] == uuid0)["health"] == "drained"
        page = r.text
        assert "Undrain" in page
        r = admin.post(hub.broker_url + f"admin/devices/{uuid0}/drain", data={}, timeout=30)
        assert r.status_code == 403, "a form without the XSRF token is refused"
        asked = admin.get(hub.broker_url + f"admin/devices/{uuid0}/undrain", timeout=30)
        assert asked.status_code == 200 and "Undrain GPU 0?" in asked.text
        r = admin.post(
            hub.broker_url + f"admin/devices/{uuid0}/undrain",
            data={"_xsrf": _xsrf_of(asked.text), "confirm": "yes"},
            timeout=30,
        )
        assert r.status_code == 200
        assert next(d for d in admin_status(hub)["devices"] if d["uuid"] == uuid0)["health"] == "ok"

        # Another user sees the page as the REST API shows the host to them, without admin forms.
        bob = _login(hub, "bob")
        page = bob.get(hub.broker_url, timeout=30).text
        assert "GPUs of this host" in page and "another user" in page and "alice" not in page
        assert "Drain" not in page and str(stray.pid) not in page
        assert bob.get(hub.broker_url + f"admin/devices/{uuid0}/drain", timeout=30).status_code == 403
        r = bob.post(hub.broker_url + f"admin/devices/{uuid0}/drain", data={"confirm": "yes"}, timeout=30)
        assert r.status_code == 403
        # Metrics are for admins.
        assert hub.call("GET", hub.broker_url + "metrics", hub.token("bob"))[0] == 403
        admin_token = {"Authorization": f"token {hub.token('admin')}"}
        r = requests.get(hub.broker_url + "metrics", headers=admin_token, timeout=30)
        assert r.status_code == 200 and "gpusched_gpus_held" in r.text
    finally:
        stray.kill()
        stray.wait(10)


# -- servers that stop, a broker that restarts ----------------------------------------------------
def test_stopping_a_users_server_releases_her_leases(hub):
    ka = hub.kernels.pop("alice")
    lease = lease_of(hub, "alice", ka.id)
    assert lease is not None and lease["state"] in ("active", "idle")
    ka.close()
    hub.stop_server("alice")
    admin = hub.token("admin")

    def released():
        code, got = hub.broker("GET", f"leases/{lease['id']}", admin)
        return code == 200 and got["state"] == "released" and got

    got = until(released, 60, "alice's lease to be released", hub)
    assert "shut down" in got["reason"] or "gone" in got["reason"]
    assert not any(le["user"] == "alice" and le["state"] != "released" for le in admin_status(hub)["leases"])
    assert_ledger_sound(hub)


def test_restarting_the_broker_keeps_the_ledger_and_running_kernels_leases(hub):
    kb = hub.kernels["bob"]
    lease = lease_of(hub, "bob", kb.id)
    assert lease is not None and lease["state"] in ("active", "idle")
    old = hub.broker_process()
    assert old is not None
    old.send_signal(signal.SIGTERM)

    def exited() -> bool:  # a zombie until the hub reaps it
        try:
            return old.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    until(exited, 30, "the broker to stop on SIGTERM", hub)
    # The hub notices (it polls its services) and starts the broker again.
    def restarted():
        proc = hub.broker_process()
        return proc if proc is not None and proc.pid != old.pid else None

    new = until(restarted, 90, "the hub to restart the broker", hub)
    assert new.pid != old.pid
    assert "Service gpusched exited with status 0" in hub.log_path.read_text(), "it stopped cleanly on SIGTERM"
    hub.wait_broker(60)

    def bob_connected():
        servers = admin_status(hub)["servers"]
        return any(s["user"] == "bob" and s["connected"] and kb.id in s["kernels"] for s in servers)

    until(bob_connected, 60, "bob's server to reconnect", hub)
    again = lease_of(hub, "bob", kb.id)
    assert again["id"] == lease["id"] and again["devices"] == lease["devices"]
    assert again["state"] in ("active", "idle")
    out = kb.execute(VISIBLE)
    assert visible(out) == lease["devices"][0]
    assert lease_of(hub, "bob", kb.id)["id"] == lease["id"], "no new claim was needed"

    # bob restarts his kernel: the lease stays with it (the provisioner asks the broker).
    code, _ = hub.server("bob", "POST", f"api/kernels/{kb.id}/restart", {})
    assert code == 200
    kb.close()
    kb = hub.kernels["bob"] = Kernel(hub, "bob", kb.id)
    kb.ready()
    out = kb.execute(VISIBLE)
    assert visible(out) == lease["devices"][0]
    assert lease_of(hub, "bob", kb.id)["id"] == lease["id"]
    assert_ledger_sound(hub)


# -- attacks by an ordinary user ----------------------------------------------------------------
def _sim_held(hub: Hub, table: str, pid: int) -> int:
    """Bytes of ``pid`` on a simulated GPU (``processes``) or held by a checkpoint (``checkpoints``)."""
    import sqlite3

    conn = sqlite3.connect(f"file:{hub.sim_state}?mode=ro", uri=True, timeout=10)
    try:
        return int(conn.execute(f"SELECT COALESCE(SUM(memory), 0) FROM {table} WHERE pid = ?", (pid,)).fetchone()[0])
    finally:
        conn.close()


def _gpu_job(hub: Hub, uuid: str) -> subprocess.Popen:
    """A GPU job outside any kernel (someone's training script): 1 GiB on ``uuid``, then it sleeps."""
    env = {**os.environ, "JUPYTER_GPUSCHED_SIM_STATE": hub.sim_state, "CUDA_VISIBLE_DEVICES": uuid}
    job = subprocess.Popen(
        [sys.executable, "-c", "from jupyter_gpusched.devices import simulated; import time; "
         "simulated.allocate('1GiB'); print('up', flush=True); time.sleep(300)"],
        env=env, stdout=subprocess.PIPE, text=True,
    )
    assert job.stdout.readline().strip() == "up"
    return job


def _status_latency(hub: Hub, token: str, n: int = 15) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        code, _ = hub.broker("GET", "status", token)
        times.append(time.perf_counter() - start)
        assert code == 200
    return sorted(times)[n // 2]


def _maximal_heartbeat(tag: str, n_kernels: int = 128, n_pids: int = 200) -> str:
    return json.dumps({
        "type": "heartbeat",
        "kernels": {
            f"{tag}-{i}": {"busy": True, "pid": 2 + i, "last_busy_at": time.time(),
                           "pids": list(range(2 + n_pids * i, 2 + n_pids * (i + 1))),
                           "notebook": "x" * 200}
            for i in range(n_kernels)
        },
    })


def test_a_user_cannot_freeze_take_over_or_hide_another_users_gpu_job(hub):
    """Attacks by mallory, an ordinary hub user who reads her own server's token: a made-up server
    reporting someone else's GPU job as her kernel, a pid-space flood, a kernel "busy forever",
    maximal heartbeats from several connections. Each is answered as it should be; the victim's
    job and leases stay intact, and a checkpointed process whose lease goes is restored."""
    admin = hub.token("admin")
    mallory = hub.token("mallory")
    for lease in admin_status(hub)["leases"]:  # a clean host for this test
        if lease["state"] != "released":
            hub.broker("DELETE", f"leases/{lease['id']}", admin)
    until(lambda: not [le for le in admin_status(hub)["leases"] if le["state"] != "released"], 30, "no leases", hub)
    uuid0, uuid1 = [d["uuid"] for d in admin_status(hub)["devices"]]
    victim = _gpu_job(hub, uuid0)
    mserver = server_of(hub, "mallory")
    mk = hub.kernels["mallory"] = start_kernel(hub, "mallory")
    mk_pid = next(p.pid for p in psutil.Process(mserver["pid"]).children() if "ipykernel" in " ".join(p.cmdline()))
    ws = forged_connection(hub, server_token(hub, "mallory"), [
        "X-GPUSched-Server: mallory-forged", f"X-GPUSched-Pid: {mserver['pid']}",
    ])
    assert ws
    stop = threading.Event()
    problems: list[str] = []

    def heartbeats():
        while not stop.is_set():
            now = time.time()
            ws.send(json.dumps({"type": "heartbeat", "kernels": {
                "bobk": {"pid": victim.pid},
                "busyk": {"busy": True, "pid": mk_pid, "last_busy_at": now, "started_at": now - 1},
            }}))
            stop.wait(1.0)

    def reader():
        while not stop.is_set():
            try:
                problems.append(json.loads(ws.recv()).get("message", ""))
            except Exception:  # noqa: BLE001 - the socket closes at the end
                return

    threads = [threading.Thread(target=heartbeats, daemon=True), threading.Thread(target=reader, daemon=True)]
    for t in threads:
        t.start()
    forged = {"X-GPUSched-Server": "mallory-forged"}
    try:
        # 1. Her made-up server reports the victim's job as kernel "bobk": the pid is ignored.
        until(lambda: any("not a process of this server" in p for p in problems), 20, "the pid refused", hub)
        code, bobk = hub.broker("POST", "leases", mallory, {"kernel_id": "bobk"}, headers=forged)
        assert code == 201, bobk
        # 2. "busyk" is her own (sleeping) kernel's process, reported busy every second.
        code, busyk = hub.broker("POST", "leases", mallory, {"kernel_id": "busyk"}, headers=forged)
        assert code == 201, busyk
        until(lambda: hub.broker("GET", f"leases/{busyk['id']}", mallory)[1]["state"] == "idle", 30,
              "the 'busy forever' lease to count idle: its process never runs", hub)
        status = admin_status(hub)
        assert any(p["pid"] == victim.pid for p in status["unleased_processes"]), "the victim's job stays unleased"
        shown = [p for d in status["devices"] for p in d["processes"] if p["pid"] == victim.pid]
        assert shown and shown[0]["kernel_id"] is None, "the job is attributed to no kernel"
        assert hub.broker("GET", f"leases/{bobk['id']}", mallory)[1]["memory_held"] in (0, None)
        # Someone waits: mallory's idle, borrowed leases are taken back; the victim is untouched.
        kc = hub.kernels["carol"]
        out = kc.execute(VISIBLE, timeout=90)
        assert out["error"] is None and visible(out)
        kc2 = hub.kernels["carol2"] = start_kernel(hub, "carol")
        out = kc2.execute(VISIBLE, timeout=90)
        assert out["error"] is None and visible(out)
        assert victim.poll() is None and _sim_held(hub, "checkpoints", victim.pid) == 0
        assert _sim_held(hub, "processes", victim.pid) == 1 << 30, "the job keeps its GPU memory"

        # 3. A pid-space flood: every pid ignored; a new GPU job is still nobody's kernel's.
        ws.send(_maximal_heartbeat("flood"))
        victim2 = _gpu_job(hub, uuid1)
        try:
            until(lambda: any(p["pid"] == victim2.pid for p in admin_status(hub)["unleased_processes"]), 30,
                  "a new GPU job to show as unleased", hub)
        finally:
            victim2.kill()
            victim2.wait(10)

        # 4. Maximal heartbeats from three more connections: the broker stays within 2x.
        broker = hub.broker_process()
        rss_before = broker.memory_info().rss
        latency_before = _status_latency(hub, admin)
        socks = []
        for n in range(3):
            sock = forged_connection(hub, server_token(hub, "mallory"), [
                f"X-GPUSched-Server: mallory-max-{n}", f"X-GPUSched-Pid: {mserver['pid']}",
            ])
            assert sock
            socks.append(sock)
        for _ in range(5):
            for n, sock in enumerate(socks):
                sock.send(_maximal_heartbeat(f"max{n}"))
        time.sleep(3)
        rss_during = broker.memory_info().rss
        latency_during = _status_latency(hub, admin)
        assert rss_during <= 2 * rss_before, (rss_before, rss_during)
        assert latency_during <= max(2 * latency_before, latency_before + 0.02), (latency_before, latency_during)
        too_big = json.dumps({"type": "heartbeat", "kernels": {"k": {"notebook": "x" * 300_000}}})
        socks[0].send(too_big)
        for sock in socks:
            sock.close()
        until(lambda: not [s for s in admin_status(hub)["servers"] if s["server_id"].startswith("mallory-max")],
              90, "the silent servers to be forgotten", hub)
        assert broker.memory_info().rss <= 2 * rss_before
        assert _status_latency(hub, admin) <= max(2 * latency_before, latency_before + 0.02)

        # 5. A checkpointed process whose lease goes is restored: carol's kernel holds 1 GiB, is
        # suspended for a waiting claim (her other kernel computes meanwhile), then her suspended
        # lease is released.
        spin = kc2.submit(VISIBLE + "\nimport time\nt = time.time()\nwhile time.time() - t < 45: pass")
        until(lambda: seen_busy(hub, "carol", kc2.id), 60, "carol2 computing", hub)
        out = kc.execute("from jupyter_gpusched.devices import simulated\nsimulated.allocate('1GiB')", timeout=90)
        assert out["error"] is None, out
        until(lambda: (lease_of(hub, "carol", kc2.id) or {}).get("state") == "active", 60, "carol2 computing", hub)
        kc_lease = lease_of(hub, "carol", kc.id)
        kc_pid = next(p.pid for p in psutil.Process(server_of(hub, "carol")["pid"]).children()
                      if _sim_held(hub, "processes", p.pid) == 1 << 30)
        code, wait = hub.broker("POST", "leases", mallory, {"kernel_id": "waiter"}, headers=forged)
        assert code in (201, 202), wait
        until(lambda: (lease_of(hub, "carol", kc.id) or {}).get("state") == "suspended", 60,
              "carol's idle lease to be checkpointed", hub)
        assert _sim_held(hub, "checkpoints", kc_pid) == 1 << 30
        until(lambda: hub.broker("GET", f"leases/{wait['id']}", mallory)[1].get("state") == "active", 30,
              "the waiter to hold carol's GPU", hub)
        assert hub.server("carol", "DELETE", f"api/gpusched/leases/{kc_lease['id']}")[0] == 204
        # Its GPU is the waiter's now: the process stays checkpointed rather than share it ...
        time.sleep(2.0)
        assert _sim_held(hub, "checkpoints", kc_pid) == 1 << 30, "never restored onto another lease's GPU"
        # ... until that GPU is free again.
        assert hub.broker("DELETE", f"leases/{wait['id']}", mallory, headers=forged)[0] == 204
        until(lambda: _sim_held(hub, "checkpoints", kc_pid) == 0, 30, "the process to be restored", hub)
        assert _sim_held(hub, "processes", kc_pid) == 1 << 30, "its GPU memory is back"
        with Ledger(hub.ledger_path) as ledger:
            assert ledger.checkpoints() == []
        assert kc2.result(spin, 90)["error"] is None
    finally:
        stop.set()
        ws.close()
        victim.kill()
        victim.wait(10)
    assert victim.returncode == -signal.SIGKILL, "nobody but this test ended the victim's job"
    assert_ledger_sound(hub)
