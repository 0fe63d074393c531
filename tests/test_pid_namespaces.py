"""PID namespaces, for real: processes in new namespaces (``unshare --pid --fork --mount-proc``).

NVML names GPU processes by their host pid; a single-user server in a container (a Kubernetes
pod) knows itself and its kernels by the pids of its own PID namespace. These tests start real
namespaces and check that the broker maps what such a server reports to host pids (and refuses
a forged pair), that the simulated GPUs record a process the way the driver does (its host pid),
and that the GPU processes of a server's pod are attributed to its kernel, its server and its pod.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time

import psutil
import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_gpusched import procs
from jupyter_gpusched.api.routes import HOST_HEADER, PID_HEADER, PIDNS_HEADER, SERVER_HEADER
from jupyter_gpusched.devices.simulated import STATE_ENV, SimulatedBackend
from jupyter_gpusched.hub.remote import RemoteKernels

from test_hub_broker import Setup, run, until

UNSHARE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


def _unshare_problem() -> str | None:
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    try:
        done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare does not run here: {exc}"
    if done.returncode != 0:
        return f"unshare may not make a PID namespace here (it needs root): {done.stderr.strip()}"
    return None


_PROBLEM = _unshare_problem()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


class Namespaced:
    """A Python process as pid 1 of a new PID namespace (and, given ``hostname``, a UTS namespace
    with that host name, as in a pod). It prints one JSON line, then runs until its stdin closes;
    ending it ends every process of its namespace."""

    def __init__(
        self, code: str, *args: str, role: str = "sleeper", env: dict | None = None, hostname: str | None = None
    ) -> None:
        # The role in the command line lets the host side tell the namespace's processes apart.
        code = f"{code}\n# ROLE={role}\n"
        command = [*UNSHARE, *(["--uts"] if hostname else []), sys.executable, "-c", code, *args]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), **({"POD_HOSTNAME": hostname} if hostname else {})},
        )
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise AssertionError(f"the process in the new namespace ended early ({self.proc.returncode})")
        self.report = json.loads(line)

    def host_pids(self) -> dict[str, int]:
        """The processes of the namespace as the host sees them, by a word of their command line
        (found from the host's side: the descendants of the unshare process)."""
        out = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                cmdline = " ".join(child.cmdline())
            except psutil.Error:
                continue
            roles = re.findall(r"ROLE=(\w+)", cmdline)
            if roles:
                out[roles[-1]] = child.pid  # the last: code may name the roles of its children
        return out

    def close(self) -> None:
        if self.proc.stdout.closed:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()

    def __enter__(self) -> Namespaced:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Says who it is (its namespace and pid there), then sleeps until stdin closes.
SLEEPER = """
import json, os, sys
from jupyter_gpusched import procs
print(json.dumps({"ns": procs.own_pid_namespace(), "pid": os.getpid(), "nspid": procs.ns_pids(os.getpid())}), flush=True)
sys.stdin.read()
"""

#: Allocates simulated GPU memory (``sys.argv[1]``) from inside the namespace, says what it sees.
ALLOCATOR = """
import json, os, sys
from jupyter_gpusched import procs
from jupyter_gpusched.devices import simulated
uuid = simulated.allocate(sys.argv[1])
print(json.dumps({"ns": procs.own_pid_namespace(), "pid": os.getpid(), "uuid": uuid,
                  "held": simulated.memory_allocated()}), flush=True)
line = sys.stdin.readline()
if line.strip() == "free":
    print(json.dumps({"freed": simulated.free()}), flush=True)
    sys.stdin.read()
"""


# -- the mapping ------------------------------------------------------------------------------


def test_a_process_in_a_new_pid_namespace_is_found_under_its_host_pid():
    mapper = procs.PidNamespaces()
    own = procs.pid_namespace()
    assert mapper.host_pid(own, os.getpid()) == os.getpid(), "the broker's own namespace maps to itself"
    with Namespaced(SLEEPER) as inside:
        ns, pid = inside.report["ns"], inside.report["pid"]
        assert pid == 1 and ns != own, inside.report
        assert inside.report["nspid"] == [1], "its /proc shows only its own namespace"
        host = inside.host_pids()["sleeper"]
        assert host != 1
        assert mapper.host_pid(ns, pid) == host
        assert procs.namespace_pid(host) == (ns, 1), "the host sees how the process names itself"
        assert procs.ns_pids(host) == (host, 1)
        scans = mapper.scans
        assert mapper.host_pid(ns, pid) == host
        assert mapper.scans == scans, "a second lookup is answered from the map, without a pass over /proc"
        assert mapper.host_pid(ns, 4242) is None, "no such process in that namespace"
        assert "no process 4242 runs in PID namespace" in mapper.describe_missing(ns, 4242)
    # Gone with its namespace: no longer found (after the map is made again).
    mapper.min_rescan = 0
    assert mapper.host_pid(ns, pid) is None
    assert mapper.seen(ns)


def test_a_process_outside_the_hosts_pid_namespace_is_told_to_run_with_host_pid():
    # From inside a new namespace, the host's namespace cannot be seen: /proc cannot tell.
    code = (
        "import json, sys\n"
        "from jupyter_gpusched import procs\n"
        "m = procs.PidNamespaces()\n"
        "try:\n"
        "    m.host_pid(int(sys.argv[1]), int(sys.argv[2]))\n"
        "    out = {'error': None}\n"
        "except procs.PidNamespaceError as exc:\n"
        "    out = {'error': str(exc)}\n"
        "print(json.dumps({**out, 'in_host': m.in_host_namespace}), flush=True)\n"
    )
    with Namespaced(code, str(procs.pid_namespace()), str(os.getpid())) as inside:
        assert inside.report["in_host"] is False
        assert inside.report["error"] and "hostPID" in inside.report["error"], inside.report


# -- simulated GPUs record processes as the driver does -----------------------------------------


@pytest.fixture
def backend(tmp_path):
    return SimulatedBackend(2, state_path=str(tmp_path / "sim.sqlite"))


def _gpu_env(backend: SimulatedBackend, index: int = 0) -> dict[str, str]:
    return {**backend.env(), "CUDA_VISIBLE_DEVICES": backend.snapshot()[index].uuid}


def _processes(backend: SimulatedBackend, index: int = 0) -> dict[int, int | None]:
    return {p.pid: p.memory_used for p in backend.snapshot()[index].processes}


def test_memory_allocated_inside_a_namespace_shows_under_the_host_pid(backend):
    env = _gpu_env(backend)
    with Namespaced(ALLOCATOR, "1GiB", env=env) as first, Namespaced(ALLOCATOR, "2GiB", env=env) as second:
        # Both are pid 1 of their own namespace; the driver (and so the backend) tells them apart.
        assert first.report["pid"] == second.report["pid"] == 1
        assert first.report["held"] == 2**30 and second.report["held"] == 2 * 2**30
        a, b = first.host_pids()["sleeper"], second.host_pids()["sleeper"]
        assert _processes(backend) == {a: 2**30, b: 2 * 2**30}
        # Checkpoint and restore take the host pid, as they do for NVML's processes.
        assert backend.checkpoint(a) == 2**30
        assert backend.checkpointed(a) == 2**30
        assert _processes(backend) == {b: 2 * 2**30}
        assert backend.restore(a) == 2**30
        assert _processes(backend) == {a: 2**30, b: 2 * 2**30}
        backend.set_process(env["CUDA_VISIBLE_DEVICES"], b, utilization=70)
        assert {p.pid: p.utilization for p in backend.snapshot()[0].processes}[b] == 70
        # Freeing from inside frees that process's memory only.
        first.proc.stdin.write("free\n")
        first.proc.stdin.flush()
        assert json.loads(first.proc.stdout.readline()) == {"freed": 2**30}
        assert _processes(backend) == {b: 2 * 2**30}
        assert backend.remove_process(b) == 2 * 2**30
        assert _processes(backend) == {}


def test_the_memory_of_a_process_that_ended_in_its_namespace_is_freed(backend):
    env = _gpu_env(backend)
    with Namespaced(ALLOCATOR, "3GiB", env=env) as inside:
        host = inside.host_pids()["sleeper"]
        assert _processes(backend) == {host: 3 * 2**30}
    deadline = time.monotonic() + 10
    while _processes(backend) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes(backend) == {}
    assert backend.snapshot()[0].memory_used == 0, "the driver frees an ended process's memory"


def test_a_state_file_of_the_previous_schema_keeps_its_processes(tmp_path):
    path = tmp_path / "sim.sqlite"
    SimulatedBackend(1, state_path=str(path))  # the devices table as it is
    conn = sqlite3.connect(path)
    uuid = conn.execute("SELECT uuid FROM devices").fetchone()[0]
    # Schema 1: processes by pid alone.
    conn.executescript(
        "DROP TABLE processes; DROP TABLE checkpoints;"
        "CREATE TABLE processes (pid INTEGER NOT NULL, started REAL, uuid TEXT NOT NULL,"
        " memory INTEGER NOT NULL DEFAULT 0, utilization REAL NOT NULL DEFAULT 0, PRIMARY KEY (pid, uuid));"
        "CREATE TABLE checkpoints (pid INTEGER NOT NULL, started REAL, uuid TEXT NOT NULL,"
        " memory INTEGER NOT NULL, utilization REAL NOT NULL DEFAULT 0, PRIMARY KEY (pid, uuid));"
        "PRAGMA user_version = 1;"
    )
    conn.execute(
        "INSERT INTO processes (pid, started, uuid, memory) VALUES (?, ?, ?, ?)",
        (os.getpid(), procs.started(os.getpid()), uuid, 5 * 2**20),
    )
    conn.commit()
    conn.close()
    backend = SimulatedBackend(1, state_path=str(path))
    assert _processes(backend) == {os.getpid(): 5 * 2**20}
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
        assert conn.execute("SELECT ns FROM processes").fetchone()[0] == procs.pid_namespace()


# -- the broker maps what a server in a namespace reports --------------------------------------

#: A single-user server stand-in in its own namespace: pid 1 of it, with a "kernel" child.
SERVER_WITH_KERNEL = """
import json, os, socket, subprocess, sys
from jupyter_gpusched import procs
if os.environ.get("POD_HOSTNAME"):
    socket.sethostname(os.environ["POD_HOSTNAME"])
kernel = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()  # ROLE=kernel"], stdin=subprocess.PIPE)
print(json.dumps({"ns": procs.own_pid_namespace(), "pid": os.getpid(), "kernel": kernel.pid}), flush=True)
sys.stdin.read()
kernel.kill()
"""


class Conn:
    async def order(self, action: str, kernel_id: str) -> None:
        raise AssertionError("no orders here")


def test_the_broker_maps_a_servers_pids_from_its_namespace():
    kernels = RemoteKernels("broker", heartbeat_timeout=10)
    with Namespaced(SERVER_WITH_KERNEL, role="server", hostname="jupyter-alice") as pod:
        ns, pid, kernel_ns_pid = pod.report["ns"], pod.report["pid"], pod.report["kernel"]
        hosts = pod.host_pids()
        assert pid == 1 and kernel_ns_pid != hosts["kernel"]
        host = kernels.server_process(pid, ns)
        assert host == hosts["server"]
        kernels.connect("pod-1", "alice", host, Conn(), procs.started(host), pid_ns=ns, ns_pid=pid, hostname="jupyter-alice")
        assert kernels.heartbeat("pod-1", {"k1": {"pid": kernel_ns_pid, "busy": False}}) == []
        # From here on the kernel is its host process: what NVML reports, what the tree walk starts from.
        assert kernels.kernel_pid("k1") == hosts["kernel"]
        assert kernels.process_trees()["k1"] == {hosts["kernel"]}
        assert kernels.owner_of(hosts["kernel"]) == {"server_id": "pod-1", "user": "alice", "pod": "jupyter-alice"}
        (listed,) = kernels.servers()
        assert listed["pid"] == hosts["server"] and listed["pod"] == "jupyter-alice"
        # A pid that is not in the server's namespace is not taken.
        problems = kernels.heartbeat("pod-1", {"k1": {"pid": 4242}})
        assert problems and "no process 4242 runs in PID namespace" in problems[0], problems
        assert kernels.kernel_pid("k1") is None
        # A process of the broker's own namespace is never a server's in another namespace.
        assert kernels.owner_of(os.getpid())["server_id"] is None
        # A server in the broker's own namespace: pids are taken as they are, as before.
        assert kernels.server_process(os.getpid(), procs.pid_namespace()) == os.getpid()
        assert kernels.server_process(os.getpid(), None) == os.getpid()


def test_a_forged_namespace_and_pid_pair_is_refused():
    kernels = RemoteKernels("broker", heartbeat_timeout=10)
    with Namespaced(SERVER_WITH_KERNEL, role="server") as pod:
        ns = pod.report["ns"]
        with pytest.raises(procs.NotTheirs, match="no process 4242 runs in PID namespace"):
            kernels.server_process(4242, ns)
        # A namespace that does not exist (nor ever did, for this broker).
        with pytest.raises(procs.NotTheirs, match="no process runs in PID namespace"):
            kernels.server_process(1, 4026500001)


# -- the whole path, through the broker's websocket -----------------------------------------------

#: A single-user server in a pod: a real BrokerClient (sys.argv[1] is the broker's URL), with a
#: kernel that computes on a simulated GPU and a stray process that only holds memory.
POD_SERVER = """
import asyncio, json, os, socket, subprocess, sys, time
from jupyter_gpusched import procs
from jupyter_gpusched.arbiter.remote import BrokerClient
socket.sethostname(os.environ["POD_HOSTNAME"])
HOLD = (
    "import sys; from jupyter_gpusched.devices import simulated; simulated.allocate('1GiB'); "
    "simulated.set_utilization(float(sys.argv[1])); print('ok', flush=True); sys.stdin.read()"
)

def start(utilization, role):
    proc = subprocess.Popen([sys.executable, "-c", HOLD + "  # ROLE=" + role, str(utilization)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ok"
    return proc

class Kernels:
    server_id = "pod-server-1"
    def __init__(self):
        self.kernel = start(60, "kernel")
    def activity(self):
        return {"k-pod-1": (False, None, None)}
    def alive(self, kernel_id):
        return kernel_id == "k-pod-1"
    def restarting(self, kernel_id):
        return False
    def kernel_pid(self, kernel_id):
        return self.kernel.pid
    def process_tree(self, kernel_id):
        return {self.kernel.pid}
    def notebook(self, kernel_id):
        return "pod.ipynb"
    async def refresh_notebooks(self):
        return None

async def main():
    kernels = Kernels()
    stray = start(0, "stray")
    client = BrokerClient(sys.argv[1], kernels=kernels, user="alice")
    await client.start()
    print(json.dumps({"ns": procs.own_pid_namespace(), "pid": os.getpid(), "kernel": kernels.kernel.pid,
                      "stray": stray.pid, "connected": client.connected}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await client.stop()
    for proc in (kernels.kernel, stray):
        proc.kill()

asyncio.run(main())
"""


async def _refused(url: str, token: str, headers: dict[str, str]) -> tuple[int | None, str | None]:
    """Connect as a server with these headers; how the broker closed the connection."""
    request = HTTPRequest(
        url.replace("http://", "ws://") + "api/gpusched/servers/connect",
        headers={"Authorization": f"token {token}", **headers},
    )
    ws = await websocket_connect(request)
    try:
        message = await asyncio.wait_for(ws.read_message(), 10)
        assert message is None, f"the broker took the connection: {message}"
        return ws.close_code, ws.close_reason
    finally:
        ws.close()


def test_a_server_in_a_pod_is_scheduled_by_its_host_pids(tmp_path):
    # The broker checks each server's process for real here: its environment holds the token.
    # A heartbeat late by more than the usual 2 s (a loaded machine) must not make the pod's
    # server count as silent here: this test is about the namespace mapping.
    setup = Setup(tmp_path, verify_server_processes=True, idle_timeout=0.5, heartbeat_timeout=10.0)

    async def scenario():
        app = await setup.start_broker()
        http = AsyncHTTPClient(force_instance=True)
        backend = app.arbiter.backend
        uuid = app.arbiter.state.snapshot[0].uuid
        env = {
            STATE_ENV: backend.state_path,
            "CUDA_VISIBLE_DEVICES": uuid,
            "JUPYTERHUB_API_TOKEN": "tok-alice",
            "JUPYTERHUB_USER": "alice",
        }
        # Started off the event loop: the broker answers the server's connection meanwhile.
        pod = await asyncio.to_thread(
            Namespaced, POD_SERVER, setup.url, role="server", env=env, hostname="jupyter-alice"
        )
        try:
            assert pod.report["connected"], "the server in the pod connected to the broker"
            hosts = pod.host_pids()
            ns = pod.report["ns"]
            assert pod.report["pid"] == 1 and ns != procs.pid_namespace()

            # The server and its kernel, as the broker holds them: host pids.
            (server,) = app.kernels.servers()
            assert server["pid"] == hosts["server"] and server["pod"] == "jupyter-alice"
            await until(lambda: app.kernels.kernel_pid("k-pod-1") == hosts["kernel"], 30, "the kernel's host pid")
            assert pod.report["kernel"] != hosts["kernel"]

            # NVML's view (host pids) meets the kernels' trees: the kernel's GPU process is its own.
            await until(
                lambda: {p.pid for p in app.arbiter.state.snapshot[0].processes} == {hosts["kernel"], hosts["stray"]},
                90,
                "the GPU processes under their host pids",
            )
            await until(
                lambda: app.arbiter.state.process_kernels.get(hosts["kernel"]) == "k-pod-1", 30, "the GPU process mapped"
            )

            # Outside every lease: each named with its server, its user and its pod.
            async def admin_status():
                r = await http.fetch(
                    HTTPRequest(setup.url + "api/gpusched/status", headers={"Authorization": "token tok-root"})
                )
                return json.loads(r.body)

            status = await admin_status()
            unleased = {p["pid"]: p for p in status["unleased_processes"]}
            assert unleased[hosts["kernel"]]["kernel_id"] == "k-pod-1"
            for role in ("kernel", "stray"):
                item = unleased[hosts[role]]
                assert (item["server_id"], item["user"], item["pod"]) == ("pod-server-1", "alice", "jupyter-alice"), item

            # A lease for the kernel: its GPU use, measured on the host pid, keeps it active.
            claim = await http.fetch(
                HTTPRequest(
                    setup.url + "api/gpusched/leases",
                    method="POST",
                    body=json.dumps({"kernel_id": "k-pod-1"}),
                    headers={"Authorization": "token tok-alice", SERVER_HEADER: "pod-server-1"},
                ),
                raise_error=False,
            )
            # Granted at once, or (where a tick saw the kernel's own 1 GiB without its process tree
            # yet, so the GPU looked 2 GiB full outside the leases) at a tick soon after.
            assert claim.code in (201, 202), claim.body
            lease_id = json.loads(claim.body)["id"]

            def lease():
                return next(le for le in app.arbiter.state.leases if le.id == lease_id)

            await until(lambda: lease().state.value in ("active", "idle"), 30, "the kernel's lease to be granted")

            await asyncio.sleep(2.0)  # four idle timeouts
            assert lease().state.value == "active", lease()
            status = await admin_status()
            assert hosts["kernel"] not in {p["pid"] for p in status["unleased_processes"]}
            # The kernel stops computing (set through the backend, by its host pid): now it idles.
            backend.set_process(uuid, hosts["kernel"], utilization=0)
            await until(lambda: lease().state.value == "idle", 30, "the lease to count idle")

            # Forged pairs are refused: a pid that is not in the namespace named...
            code, reason = await _refused(
                setup.url, "tok-alice", {SERVER_HEADER: "forged-1", PID_HEADER: "4242", PIDNS_HEADER: str(ns)}
            )
            assert code == 4403 and "no process 4242 runs in PID namespace" in reason, reason
            # ... another user's server, by its namespace and pid...
            code, reason = await _refused(
                setup.url, "tok-bob", {SERVER_HEADER: "forged-2", PID_HEADER: "1", PIDNS_HEADER: str(ns)}
            )
            assert code == 4403 and "not a server started with this token" in reason, reason
            # ... or by its host pid in the broker's namespace...
            code, reason = await _refused(
                setup.url, "tok-bob", {SERVER_HEADER: "forged-3", PID_HEADER: str(hosts["server"])}
            )
            assert code == 4403 and "not a server started with this token" in reason, reason
            # ... a namespace that does not exist, and a header that is no namespace.
            code, reason = await _refused(
                setup.url, "tok-alice", {SERVER_HEADER: "forged-4", PID_HEADER: "1", PIDNS_HEADER: "4026500001"}
            )
            assert code == 4403 and "no process runs in PID namespace" in reason, reason
            code, reason = await _refused(
                setup.url, "tok-alice", {SERVER_HEADER: "forged-5", PID_HEADER: "1", PIDNS_HEADER: "pid:[1]"}
            )
            assert code == 4400, reason
            code, reason = await _refused(
                setup.url,
                "tok-alice",
                {SERVER_HEADER: "forged-6", PID_HEADER: "1", PIDNS_HEADER: str(ns), HOST_HEADER: "bad host/name"},
            )
            assert code == 4400, reason
            assert [s["server_id"] for s in app.kernels.servers()] == ["pod-server-1"]
        finally:
            await asyncio.to_thread(pod.close)
            http.close()
            await setup.close()

    run(scenario())


# -- the pod a server is in: found by the broker, not taken from the server ---------------------


def test_a_servers_pod_is_the_one_its_process_is_in_whatever_it_says(caplog):
    """A server that reports another pod's name (``X-GPUSched-Host: jupyter-bob``) is shown in its
    own pod; one in no pod of its own is shown in none, whatever it says."""
    kernels = RemoteKernels("broker", heartbeat_timeout=10)
    with Namespaced(SERVER_WITH_KERNEL, role="server", hostname="jupyter-alice") as pod, Namespaced(
        SERVER_WITH_KERNEL, role="server"
    ) as bare:
        host = pod.host_pids()["server"]
        assert procs.pod_name(host) == "jupyter-alice"
        with caplog.at_level("WARNING", "jupyter_gpusched.broker"):
            kernels.connect(
                "pod-1", "alice", host, Conn(), procs.started(host),
                pid_ns=pod.report["ns"], ns_pid=1, hostname="jupyter-bob",
            )
        assert "says it runs in pod jupyter-bob, but its process" in caplog.text
        # A PID namespace of its own, but the broker's host name (no UTS namespace of its own).
        other = bare.host_pids()["server"]
        assert procs.pod_name(other) is None
        kernels.connect(
            "ns-2", "alice", other, Conn(), procs.started(other),
            pid_ns=bare.report["ns"], ns_pid=1, hostname="jupyter-bob",
        )
        pods = {s["server_id"]: s["pod"] for s in kernels.servers()}
        assert pods == {"pod-1": "jupyter-alice", "ns-2": None}
        for kernel_pid, server_id, pod_name in (
            (pod.host_pids()["kernel"], "pod-1", "jupyter-alice"),
            (bare.host_pids()["kernel"], "ns-2", None),
        ):
            assert kernels.owner_of(kernel_pid) == {"server_id": server_id, "user": "alice", "pod": pod_name}
    # The broker's own host name is no pod.
    assert procs.pod_name(os.getpid()) is None


def test_a_pod_named_from_a_user_namespace_of_its_own_is_not_believed():
    """A user who makes a user namespace may name its UTS namespace as they like: no pod."""
    code = SERVER_WITH_KERNEL
    command = ["unshare", "--user", "--map-root-user", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
    done = subprocess.run([*command, "true"], capture_output=True, timeout=30)
    if done.returncode != 0:
        pytest.skip("no user namespaces here")
    proc = subprocess.Popen(
        [*command, sys.executable, "-c", code + "\n# ROLE=server\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "POD_HOSTNAME": "jupyter-bob"},
    )
    try:
        assert proc.stdout.readline()
        (server,) = [c.pid for c in psutil.Process(proc.pid).children(recursive=True) if "ROLE=server" in " ".join(c.cmdline())]
        assert procs.pod_name(server) is None
    finally:
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()


#: A pod whose pid 1 is not the server: it starts the server, and a PID namespace of its own
#: (``unshare`` again) whose process holds GPU memory, under the pod's pid 1.
POD_WITH_NESTED_NAMESPACE = """
import json, os, socket, subprocess, sys
from jupyter_gpusched import procs
socket.sethostname(os.environ["POD_HOSTNAME"])
server = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()  # ROLE=server"], stdin=subprocess.PIPE)
nested = subprocess.Popen(
    ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c",
     "import sys; print('ok', flush=True); sys.stdin.read()  # ROLE=nested"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
assert nested.stdout.readline().strip() == "ok"
print(json.dumps({"ns": procs.own_pid_namespace(), "server": server.pid}), flush=True)
sys.stdin.read()
server.kill()
nested.kill()
"""


def test_a_process_in_a_namespace_made_inside_a_pod_is_the_pods():
    kernels = RemoteKernels("broker", heartbeat_timeout=10)
    with Namespaced(POD_WITH_NESTED_NAMESPACE, role="init", hostname="jupyter-alice") as pod:
        hosts = pod.host_pids()
        server = hosts["server"]
        # The nested namespace's process (unshare itself, in the pod's namespace, has the same role).
        (nested,) = [
            c.pid for c in psutil.Process(pod.proc.pid).children(recursive=True)
            if "ROLE=nested" in " ".join(c.cmdline()) and len(procs.ns_pids(c.pid)) == 3
        ]
        assert pod.report["server"] != 1, "the pod's pid 1 is not the server"
        chain = procs.pid_namespace_chain(nested)
        assert len(chain) == 2 and chain[-1] == pod.report["ns"] and chain[0] == procs.pid_namespace(nested)
        assert procs.pid_namespace_chain(server) == [pod.report["ns"]]
        assert procs.pid_namespace_chain(os.getpid()) == []
        kernels.connect(
            "pod-1", "alice", server, Conn(), procs.started(server),
            pid_ns=pod.report["ns"], ns_pid=pod.report["server"], hostname="jupyter-alice",
        )
        assert server not in procs.ancestors(nested), "not under the server's process"
        assert kernels.owner_of(nested) == {"server_id": "pod-1", "user": "alice", "pod": "jupyter-alice"}
        assert kernels.owner_of(hosts["init"]) == {"server_id": "pod-1", "user": "alice", "pod": "jupyter-alice"}


#: A pod as the kubelet makes one: its host name in its UTS namespace and in the file mounted on
#: its /etc/hostname.
POD_WITH_HOSTNAME_FILE = """
import json, os, socket, subprocess, sys, tempfile
from jupyter_gpusched import procs
name = os.environ["POD_HOSTNAME"]
socket.sethostname(name)
fd, path = tempfile.mkstemp()
os.write(fd, (name + "\\n").encode())
os.close(fd)
subprocess.run(["mount", "--bind", path, "/etc/hostname"], check=True)
print(json.dumps({"ns": procs.own_pid_namespace(), "pid": os.getpid()}), flush=True)
sys.stdin.read()
os.unlink(path)
"""


def test_a_broker_that_cannot_join_a_pods_uts_namespace_reads_the_pods_hostname_file(monkeypatch):
    """A broker without CAP_SYS_ADMIN (the DaemonSet's: root with SYS_PTRACE only) reads the pod's
    name from the /etc/hostname the kubelet mounts into it."""
    with Namespaced(POD_WITH_HOSTNAME_FILE, role="server", hostname="jupyter-carol") as pod:
        host = pod.host_pids()["server"]
        assert procs.pod_name(host) == "jupyter-carol"
        monkeypatch.setattr(procs, "_uts_nodename", lambda fd: None)
        assert procs.pod_name(host) == "jupyter-carol"
        with Namespaced(SERVER_WITH_KERNEL, role="server", hostname="jupyter-carol") as bare:
            # No file of its own on /etc/hostname: the host's name is no pod's.
            assert procs.pod_name(bare.host_pids()["server"]) is None
