"""Beyond one host, on one machine: a real JupyterHub, two node brokers, servers in pods.

Two "nodes", each with its own GPU broker, simulated GPUs and ledger: ``node-a`` with one GPU
and ``node-b`` with two. Both brokers run outside the hub, as the node brokers of a Kubernetes
cluster do (the DaemonSet of deploy/kubernetes): each acts as the hub service ``gpusched`` with
its token, one of them is the URL the hub registers for the service, and each node's servers
reach their own node's broker directly. Every single-user server starts in a PID and UTS
namespace of its own (``unshare --pid --fork --mount-proc --uts``, host name ``jupyter-<user>``),
as in a pod; the hub's spawn hook (``jupyter_gpusched.kubernetes.choose_broker``) picks its node,
and the "pod" uses that node's GPUs (the node's simulated GPU state file) and broker.

The tests of this module run in order on one hub: alice lands on the node with the most free
GPUs and her kernels fill it; GPU memory is attributed to its kernel through the PID namespace
mapping; bob, a new user, lands on the other node; the admin page shows both nodes; a GPU process
started in bob's pod outside any kernel is reported with his pod; alice's idle kernel is
checkpointed for a claim that waits on her node, and restored at its next cell. Times are real
but short (idle after 5 s).

Each runs in both GPU modes of deploy/kubernetes/ where the mode matters. Device-plugin mode: the
hook is ``choose_broker`` and the "pod" runs on the node it names. DRA mode: the hub's pre-spawn
hook builds the GPU pod with a real KubeSpawner and the DRA hook ``claim_gpu_node``, which keeps the
chosen node's ResourceClaim in a stand-in Kubernetes API (tests/kube_api.py, with the official
client; it says there what it does not check) and names it in the pod; the "pod"
(tests/multinode_pod.py) reserves the claim as the scheduler would, allocating it on the required
node when it is not allocated, and runs the server on the node THE CLAIM IS ALLOCATED ON. The tests
after placement (admin page, a stray process, a checkpoint across the namespace) do not depend on
the mode and run once, in device-plugin mode. No real cluster is run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import json

from jupyter_gpusched import kubernetes, nodeclaims, procs

from hub_util import EXAMPLE, Hub, free_port, start_kernel
from kube_api import KubeAPI
from test_hub import BROKER, VISIBLE, _login, until, visible
from test_pid_namespaces import _PROBLEM, UNSHARE

pytestmark = [
    pytest.mark.hub,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or ""),
]

GIB = 1 << 30
#: Each node's GPUs, told apart by their model as a user sees them.
NODE_GPUS = {
    "node-a": [{"name": "NVIDIA A100-SXM4-40GB", "memory": "40GiB"}],
    "node-b": [{"name": "NVIDIA H100 80GB HBM3", "memory": "80GiB"}] * 2,
}
#: Allocates 1 GiB of simulated GPU memory in the kernel and says which pid the kernel knows itself by.
ALLOCATE = (
    "\nfrom jupyter_gpusched.devices import simulated\nsimulated.allocate('1GiB')\nprint('NSPID=' + str(os.getpid()))"
)
HELD = "from jupyter_gpusched.devices import simulated\nprint('HELD=' + str(simulated.memory_allocated()))"

#: What a node does when it starts a user's pod: the server runs as pid 1 of its own PID namespace,
#: with the pod's host name, on the GPUs of the node the spawn hook chose (its simulated GPUs are
#: that node's state file). No node chosen, no server.
POD = """
: "${{GPUSCHED_NODE:?the spawn hook chose no node for this server}}"
hostname "jupyter-$JUPYTERHUB_USER"
export JUPYTER_GPUSCHED_SIM_STATE={nodes}/"$GPUSCHED_NODE"/gpus.sqlite
exec "$0" "$@"
"""

#: The hub's side of the cluster (added to the example config that tests/hub_util.py loads).
HUB_CONFIG = """
import jupyter_gpusched.kubernetes

# The node brokers run outside the hub: the service is theirs, by URL and token.
for service in c.JupyterHub.services:
    if service.get("name") == "gpusched":
        service.pop("command", None)
        service["api_token"] = {token!r}
c.Spawner.pre_spawn_hook = jupyter_gpusched.kubernetes.choose_broker
c.Spawner.cmd = {cmd!r}
# unshare does not pass signals on: stopping a server kills its "pod" (unshare, then the namespace).
c.Spawner.interrupt_timeout = 1
c.Spawner.term_timeout = 1
"""

#: DRA mode: the hub's side. The GPU profile's pod as KubeSpawner builds it, through the DRA hook;
#: what the pod names (its node's claim) and requires (a node) goes to the local "pod".
HUB_CONFIG_DRA = """
from kubespawner import KubeSpawner
from traitlets.config import Config


async def claim_node(spawner):
    config = Config()
    config.KubeSpawner.environment = {"JUPYTER_GPUSCHED_BROKER_URL": "http://$(GPUSCHED_NODE_IP):8765/services/gpusched/"}
    config.KubeSpawner.modify_pod_hook = jupyter_gpusched.kubernetes.claim_gpu_node
    kube = KubeSpawner(config=config, user=spawner.user, hub=spawner.hub)
    pod = await kube.modify_pod_hook(kube, await kube.get_pod_manifest())
    (claim,) = pod.spec.resource_claims
    (term,) = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    spawner.environment = {
        **spawner.environment,
        "GPUSCHED_POD_CLAIM": claim.resource_claim_name,
        "GPUSCHED_POD_NODE": term.match_fields[0].values[0],
    }


c.Spawner.pre_spawn_hook = claim_node
"""

#: A process in a pod that uses the node's GPU outside any kernel (as ``kubectl exec`` would start
#: it): it says which pid it has there, then holds 512 MiB until its stdin closes.
STRAY = (
    "import os, sys; from jupyter_gpusched.devices import simulated; simulated.allocate('512MiB'); "
    "print(os.getpid(), flush=True); sys.stdin.read()"
)


class NodeBroker:
    """One node's GPU broker, started as the DaemonSet starts it: its own config file, ledger and
    simulated GPUs; the hub's internal API and the ``gpusched`` service token in its environment."""

    def __init__(self, root: Path, name: str, port: int, service_token: str) -> None:
        self.name, self.port, self.service_token = name, port, service_token
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{port}/services/gpusched/"
        self.sim_state = str(self.dir / "gpus.sqlite")
        self.log_path = self.dir / "broker.log"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def write_config(self, peers: str) -> Path:
        traits = {
            "backend": "simulated",
            "simulated_devices": NODE_GPUS[self.name],
            "simulated_state_path": self.sim_state,
            "ledger_path": str(self.dir / "ledger.sqlite"),
            "poll_interval": 0.5,
            "heartbeat_interval": 1.0,
            "heartbeat_timeout": 6.0,
            "node_brokers": peers,
            **BROKER,
        }
        config = self.dir / "broker_config.py"
        config.write_text(
            "c = get_config()  # noqa: F821\n"
            f"for name, value in {traits!r}.items():\n"
            "    setattr(c.GPUBroker, name, value)\n"
        )
        return config

    def start(self, hub: Hub, peers: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUSCHED_"))}
        env.update(
            NODE_NAME=self.name,
            JUPYTERHUB_API_URL=hub.hub_api_url.rstrip("/"),
            JUPYTERHUB_API_TOKEN=self.service_token,
            JUPYTERHUB_SERVICE_NAME="gpusched",
            JUPYTERHUB_SERVICE_PREFIX="/services/gpusched/",
            JUPYTERHUB_BASE_URL="/",
            JUPYTERHUB_CLIENT_ID="service-gpusched",
            JUPYTERHUB_OAUTH_CALLBACK_URL="/services/gpusched/oauth_callback",
        )
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "jupyter_gpusched.cli", "broker",
                f"--config={self.write_config(peers)}", f"--GPUBroker.url=http://127.0.0.1:{self.port}",
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def summary(self, hub: Hub) -> dict | None:
        """``GET api/gpusched/node`` with the service token, as the spawn hook asks it."""
        code, body = hub.call("GET", self.url + kubernetes.NODE_PATH, self.service_token, timeout=10)
        return body if code == 200 else None

    def status(self, hub: Hub) -> dict:
        """The node's status as a hub admin sees it, asked of the node's broker directly."""
        code, body = hub.call("GET", self.url + "api/gpusched/status", hub.token("admin"))
        assert code == 200, (self.name, code, body)
        return body

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None


class Cluster:
    """The hub, its two node brokers, and what the tests keep between them."""

    def __init__(self, root: Path, mode: str = "device-plugin") -> None:
        token = os.urandom(16).hex()
        self.mode = mode
        self.nodes_dir = root / "nodes"
        self.api: KubeAPI | None = None
        ports = {"node-a": free_port(), "node-b": free_port()}
        if mode == "dra":
            self.api = KubeAPI()
            self.api.start()
            kubeconfig = self.api.kubeconfig(root / "kubeconfig", namespace="jhub")
            nodes = {
                name: {"url": f"http://127.0.0.1:{port}/services/gpusched/", "gpus": len(NODE_GPUS[name]),
                       "state": str(self.nodes_dir / name / "gpus.sqlite")}
                for name, port in ports.items()
            }
            cmd = [*UNSHARE, "--uts", sys.executable, str(Path(__file__).with_name("multinode_pod.py")),
                   str(kubeconfig), json.dumps(nodes), "jupyterhub-singleuser"]
            extra = HUB_CONFIG.format(token=token, cmd=cmd) + HUB_CONFIG_DRA
        else:
            pod = POD.format(nodes=shlex.quote(str(self.nodes_dir)))
            cmd = [*UNSHARE, "--uts", "sh", "-c", pod, "jupyterhub-singleuser"]
            extra = HUB_CONFIG.format(token=token, cmd=cmd)
        self.hub = Hub(root / "hub", admins=("admin",), extra_config=extra)
        # node-a is where the hub's service URL points; node-b is reached only by its own URL.
        self.hub.broker_port = ports["node-a"]
        self.nodes = {name: NodeBroker(self.nodes_dir, name, port, token) for name, port in ports.items()}
        self.peers = ",".join(f"{n.name}={n.url}" for n in self.nodes.values())
        # What the hub's spawn hook reads (as the chart's hub.extraEnv would set it).
        self.hub.hub_environment.update({kubernetes.ENV_TOKEN: token, kubernetes.ENV_NODE_BROKERS: self.peers})
        if self.api is not None:
            # The hub's claim keeper and KubeSpawner find the (stand-in) Kubernetes API here.
            self.hub.hub_environment.update(KUBECONFIG=str(kubeconfig), POD_NAMESPACE="jhub")
        self.hub.add_kernelspec("gpu")
        self.kernels: dict = {}

    def start(self) -> None:
        for node in self.nodes.values():
            node.start(self.hub, self.peers)
        self.hub.start()  # waits for node-a, the service's URL
        self.wait(lambda: all(n.summary(self.hub) for n in self.nodes.values()), 60, "both node brokers")

    def stop(self) -> None:
        for kernel in self.kernels.values():
            kernel.close()
        try:
            self.hub.stop()
        finally:
            for node in self.nodes.values():
                node.stop()
            if self.api is not None:
                self.api.stop()

    def claim_of(self, node: str) -> dict | None:
        """DRA mode: ``node``'s claim as the stand-in API server holds it."""
        return self.api.claim(nodeclaims.claim_name(node), "jhub")

    def check_placed_by_claim(self, user: str, node: str) -> None:
        """DRA mode: ``user``'s pod named ``node``'s claim, which is allocated on ``node`` and reserved for it."""
        if self.mode != "dra":
            return
        claim = self.claim_of(node)
        assert claim is not None, f"no claim for {node}"
        assert nodeclaims.allocated_node(claim) == node
        assert claim["spec"] == nodeclaims.node_claim(node)["spec"]  # all of its GPUs
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == len(NODE_GPUS[node])
        assert f"jupyter-{user}" in [r["name"] for r in claim["status"]["reservedFor"]]
        # Nothing was deleted, replaced or patched by the hub (the stand-in scheduler's PUTs aside).
        assert {m for m, p in self.api.requests if not p.endswith("/status")} <= {"GET", "POST"}

    # -- waiting, with what every node says when it fails -----------------------------------------
    def wait(self, predicate, timeout: float, what: str):
        try:
            return until(predicate, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnosis()}") from None

    def diagnosis(self) -> str:
        out = []
        for node in self.nodes.values():
            try:
                status = node.status(self.hub)
                leases = [
                    (le["user"], (le["kernel_id"] or "")[:8], le["state"], le["device_indices"], le["reason"])
                    for le in status["leases"]
                ]
                servers = [(s["user"], s["pod"], s["connected"]) for s in status["servers"]]
                view = f"leases {leases}\nqueue {status['queue']}\nservers {servers}"
            except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the failure
                view = f"(no status: {exc})"
            out.append(f"--- {node.name}\n{view}\n{node.log_tail()}")
        return "\n".join(out) + f"\n--- hub\n{self.hub.log_tail(40)}"

    # -- what the nodes say -----------------------------------------------------------------------
    def server_on(self, node: str, user: str) -> dict:
        """``user``'s server as ``node``'s broker lists it, once connected (its pid: the host's)."""

        def connected():
            servers = self.nodes[node].status(self.hub)["servers"]
            return next((s for s in servers if s["user"] == user and s["connected"]), None)

        return self.wait(connected, 60, f"{user}'s server to connect to the broker of {node}")

    def users_on(self, node: str) -> set[str]:
        return {s["user"] for s in self.nodes[node].status(self.hub)["servers"]}

    def lease(self, node: str, kernel_id: str) -> dict | None:
        """The live lease of ``kernel_id`` on ``node`` (admin view of that node's broker)."""
        code, leases = self.hub.call(
            "GET", self.nodes[node].url + f"api/gpusched/leases?kernel_id={kernel_id}", self.hub.token("admin")
        )
        assert code == 200, leases
        live = [le for le in leases if le["state"] != "released"]
        assert len(live) <= 1, live
        return live[0] if live else None

    def gpu_processes(self, node: str) -> dict[int, dict]:
        """The GPU processes ``node``'s broker sees (by host pid), with the GPU each is on."""
        return {
            p["pid"]: {**p, "uuid": d["uuid"]} for d in self.nodes[node].status(self.hub)["devices"] for p in d["processes"]
        }


def printed(out: dict, key: str) -> int:
    found = re.findall(rf"^{key}=(\d+)$", out["stdout"], re.MULTILINE)
    assert found, f"the cell printed no {key}: {out}"
    return int(found[-1])


def in_own_pod(server: dict, user: str) -> int:
    """Check that ``server`` (as a broker lists it) runs as pid 1 of a PID namespace of its own,
    in the pod ``jupyter-<user>``; returns that namespace."""
    ns, pid = procs.namespace_pid(server["pid"])
    assert ns != procs.pid_namespace() and pid == 1, (server, ns, pid)
    assert server["pod"] == f"jupyter-{user}", server
    return ns


def only_once(cluster) -> None:
    """A test that does not depend on the GPU mode runs in device-plugin mode only."""
    if cluster.mode != "device-plugin":
        pytest.skip("does not depend on the GPU mode: runs in device-plugin mode")


@pytest.fixture(scope="module", params=["device-plugin", "dra"])
def cluster(request, tmp_path_factory):
    if not EXAMPLE.exists():
        pytest.skip("examples/jupyterhub_config.py is not in this checkout")
    c = Cluster(tmp_path_factory.mktemp("cluster"), request.param)
    try:
        c.start()
        c.hub.create_users(["alice", "bob"])
        yield c
    finally:
        c.stop()


# -- placement ------------------------------------------------------------------------------------
def test_a_users_server_goes_to_the_node_with_the_most_free_gpus_in_a_pod_of_its_own(cluster):
    hub = cluster.hub
    free = {name: node.summary(hub)["free"] for name, node in cluster.nodes.items()}
    assert free == {"node-a": 1, "node-b": 2}
    hub.start_server("alice")
    server = cluster.server_on("node-b", "alice")
    cluster.alice_ns = in_own_pod(server, "alice")
    cluster.alice_server = server
    assert "alice" not in cluster.users_on("node-a")
    # The spawn hook's choice is what the server was started with.
    env = psutil.Process(server["pid"]).environ()
    assert env["GPUSCHED_NODE"] == "node-b"
    assert env["JUPYTER_GPUSCHED_BROKER_URL"] == cluster.nodes["node-b"].url
    if cluster.mode == "dra":
        # The pod named node-b's claim; where that claim is allocated is where the server runs.
        assert env["GPUSCHED_POD_CLAIM"] == nodeclaims.claim_name("node-b")
        assert cluster.claim_of("node-a") is None
    cluster.check_placed_by_claim("alice", "node-b")
    # alice sees the GPUs of her node through her own server.
    code, status = hub.server("alice", "GET", "api/gpusched/status")
    assert code == 200, status
    assert status["mode"] == "hub" and status["node"] == "node-b"
    assert [d["name"] for d in status["devices"]] == ["NVIDIA H100 80GB HBM3"] * 2


def test_gpu_memory_shows_under_the_kernel_that_allocated_it_through_the_namespace(cluster):
    hub = cluster.hub
    ka = cluster.kernels["alice-1"] = start_kernel(hub, "alice")
    out = ka.execute("import os\n" + VISIBLE + ALLOCATE)
    assert out["error"] is None, out
    gpu, ns_pid = visible(out), printed(out, "NSPID")
    lease = cluster.lease("node-b", ka.id)
    assert lease is not None and lease["devices"] == [gpu] and lease["user"] == "alice", lease
    assert cluster.lease("node-a", ka.id) is None, "the other node knows nothing of alice's kernel"

    # node-b's GPUs report the process by its host pid; the broker names its kernel. The server
    # only ever said which pid its kernel has in the pod.
    def allocated():
        found = [p for p in cluster.gpu_processes("node-b").values() if p["memory_used"] == GIB]
        return found if found and all(p["kernel_id"] for p in found) else None

    (process,) = cluster.wait(allocated, 30, "the kernel's GPU memory in node-b's status")
    host_pid = process["pid"]
    assert process["kernel_id"] == ka.id and process["uuid"] == gpu
    assert host_pid != ns_pid
    assert procs.namespace_pid(host_pid) == (cluster.alice_ns, ns_pid)
    assert procs.descends_from(host_pid, cluster.alice_server["pid"])
    assert host_pid not in {p["pid"] for p in cluster.nodes["node-b"].status(hub)["unleased_processes"]}
    assert cluster.gpu_processes("node-a") == {}
    cluster.alice_gpu, cluster.alice_host_pid = gpu, host_pid

    # alice's second kernel takes node-b's other GPU: node-b is full.
    kb = cluster.kernels["alice-2"] = start_kernel(hub, "alice")
    out = kb.execute(VISIBLE)
    assert out["error"] is None, out
    assert visible(out) not in ("", gpu)
    assert cluster.lease("node-b", kb.id)["devices"] == [visible(out)]
    assert cluster.nodes["node-b"].summary(hub)["free"] == 0


def test_a_new_user_is_placed_on_the_node_with_free_gpus_when_the_other_is_full(cluster):
    hub = cluster.hub
    summaries = {name: node.summary(hub) for name, node in cluster.nodes.items()}
    assert (summaries["node-a"]["free"], summaries["node-b"]["free"]) == (1, 0), summaries
    hub.start_server("bob")
    server = cluster.server_on("node-a", "bob")
    in_own_pod(server, "bob")
    cluster.bob_server = server
    assert "bob" not in cluster.users_on("node-b")
    assert psutil.Process(server["pid"]).environ()["GPUSCHED_NODE"] == "node-a"
    cluster.check_placed_by_claim("bob", "node-a")
    if cluster.mode == "dra":
        # node-b's claim still serves alice alone.
        assert [r["name"] for r in cluster.claim_of("node-b")["status"]["reservedFor"]] == ["jupyter-alice"]

    kb = cluster.kernels["bob"] = start_kernel(hub, "bob")
    out = kb.execute(VISIBLE)
    assert out["error"] is None, out
    lease = cluster.lease("node-a", kb.id)
    assert lease is not None and lease["devices"] == [visible(out)] and lease["user"] == "bob", lease
    code, status = hub.server("bob", "GET", "api/gpusched/status")
    assert code == 200 and status["node"] == "node-a"
    assert [d["name"] for d in status["devices"]] == ["NVIDIA A100-SXM4-40GB"]
    assert [le["state"] for le in status["leases"] if le["mine"]] in (["active"], ["idle"])
    assert cluster.nodes["node-a"].summary(hub)["free"] == 0


# -- what the admin sees ---------------------------------------------------------------------------
def test_the_admin_page_at_the_services_url_shows_every_node(cluster):
    only_once(cluster)
    hub = cluster.hub
    # The hub's login (OAuth) leads to the node broker the service's URL points at: node-a.
    page = _login(hub, "admin").get(hub.broker_url, timeout=30).text
    assert "Node <b>node-a</b>" in page and "<h2>Nodes</h2>" in page
    assert "not answering" not in page and "could not be listed" not in page
    # Both brokers are on this host's loopback address and answer well-formed summaries.
    assert "broken:" not in page and "not asked" not in page
    # node-b, as its own broker summarizes it to the other nodes: its two GPUs, both alice's.
    assert cluster.nodes["node-b"].url in page
    node_b = page[page.index("<h3>node-b</h3>") :]
    node_b = node_b[: node_b.index("</table>")]
    assert node_b.count("NVIDIA H100 80GB HBM3") == 2 and node_b.count("<td>alice</td>") == 2, node_b


def test_a_gpu_process_in_a_pod_without_a_lease_is_reported_with_its_pod(cluster):
    only_once(cluster)
    hub = cluster.hub
    node = cluster.nodes["node-a"]
    uuid = node.status(hub)["devices"][0]["uuid"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "JUPYTER_GPUSCHED_SIM_STATE": node.sim_state}
    # Into bob's pod (its PID, mount and UTS namespaces), as `kubectl exec` would go.
    stray = subprocess.Popen(
        ["nsenter", "-t", str(cluster.bob_server["pid"]), "-p", "-m", "-u", sys.executable, "-c", STRAY],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        ns_pid = int(stray.stdout.readline())
        (inside,) = psutil.Process(stray.pid).children()
        assert inside.pid != ns_pid and not procs.descends_from(inside.pid, cluster.bob_server["pid"])

        def reported():
            unleased = node.status(hub)["unleased_processes"]
            return next((p for p in unleased if p["pid"] == inside.pid), None)

        item = cluster.wait(reported, 30, "the stray GPU process among the unleased")
        assert (item["server_id"], item["user"], item["pod"]) == (
            cluster.bob_server["server_id"], "bob", "jupyter-bob"
        ), item
        assert item.get("device") == uuid and item.get("kernel_id") is None, item
        assert inside.pid not in {p["pid"] for p in cluster.nodes["node-b"].status(hub)["unleased_processes"]}
        # bob's kernel keeps its lease: the process is only reported (unleased_processes = report).
        assert cluster.lease("node-a", cluster.kernels["bob"].id)["state"] in ("active", "idle")
    finally:
        stray.stdin.close()
        stray.wait(30)
        stray.stdout.close()
    cluster.wait(lambda: not node.status(hub)["unleased_processes"], 30, "the stray process to be gone")


# -- reclaim -------------------------------------------------------------------------------------
def test_an_idle_kernel_is_checkpointed_across_the_namespace_for_a_claim_waiting_on_its_node(cluster):
    only_once(cluster)
    hub = cluster.hub
    first, second = cluster.kernels["alice-1"], cluster.kernels["alice-2"]
    second_lease = cluster.lease("node-b", second.id)
    bob_lease = cluster.lease("node-a", cluster.kernels["bob"].id)
    # A third kernel of alice asks for a GPU on her (full) node; her first kernel, idle with 1 GiB
    # on its GPU for longest, is checkpointed (its host pid, found through her pod's namespace).
    third = cluster.kernels["alice-3"] = start_kernel(hub, "alice")
    waiting = third.submit(VISIBLE)
    suspended = cluster.wait(
        lambda: (le := cluster.lease("node-b", first.id)) and le["state"] == "suspended" and le,
        90, "alice's idle kernel to be checkpointed",
    )
    out = third.result(waiting, 90)
    assert out["error"] is None, out
    assert visible(out) == cluster.alice_gpu
    # The GPUs' process list is read at the broker's next tick.
    cluster.wait(
        lambda: cluster.alice_host_pid not in cluster.gpu_processes("node-b"), 15, "its GPU memory to leave the GPU"
    )
    assert cluster.lease("node-b", second.id)["id"] == second_lease["id"], "the other lease was not touched"
    assert cluster.lease("node-a", cluster.kernels["bob"].id)["id"] == bob_lease["id"], "nor the other node"

    # Its next cell takes a GPU of node-b back and finds its memory there, restored.
    out = first.execute(HELD, timeout=120)
    assert out["error"] is None, out
    assert printed(out, "HELD") == GIB
    resumed = cluster.lease("node-b", first.id)
    assert resumed["id"] == suspended["id"] and resumed["state"] in ("active", "idle"), resumed
    back = cluster.wait(
        lambda: cluster.gpu_processes("node-b").get(cluster.alice_host_pid), 15, "its GPU memory back on a GPU"
    )
    assert back["memory_used"] == GIB and back["kernel_id"] == first.id, back
    assert back["uuid"] == resumed["devices"][0]
