"""Beyond one host: which node a GPU user's server should go to, and the node brokers' summaries.

``choose_node`` is pure and tested on its own. The node brokers are real ``GPUBroker``s in this
process (``test_hub_broker.Setup``: the hub's "whose token is this?" answered from a table),
each a "node" with its own simulated GPUs and ledger, sharing the gpusched service's token. The
spawn hook runs in a real KubeSpawner (jupyterhub-kubespawner), which builds the pod manifest as
it would for a cluster; no cluster is needed for that, only a kubeconfig it can read. Discovery
asks a local HTTPS server that answers the Kubernetes API's pod list.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import os
import ssl
from types import SimpleNamespace

import jsonschema
import pytest
from jupyterhub.objects import Hub
from jupyterhub.spawner import LocalProcessSpawner
from jupyterhub.utils import maybe_future
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpusched import kubernetes
from jupyter_gpusched.api.input import Claim
from jupyter_gpusched.api.openapi import NODE_SUMMARY, openapi_document
from jupyter_gpusched.api.views import Principal
from jupyter_gpusched.hub import broker as broker_module
from jupyter_gpusched.hub.broker import GPUBroker
from jupyter_gpusched.kubernetes import NodeBroker, choose_node, node_brokers

from hub_util import free_port
from test_hub_broker import Setup, until

SERVICE_TOKEN = "gpusched-service-token"
BROKER_URL_ENV = "http://$(GPUSCHED_NODE_IP):8765/services/gpusched/"


def summary(gpus=2, free=0, reclaimable=0, pending=0, leases=0, pending_gpus=None, servers=0, without=0):
    return {
        "node": "n", "gpus": gpus, "free": free, "reclaimable": reclaimable, "pending": pending,
        "pending_gpus": pending if pending_gpus is None else pending_gpus, "leases": leases,
        "servers": servers, "servers_without_lease": without,
    }


# -- choose_node -------------------------------------------------------------------------------
def test_no_node_is_chosen_when_no_broker_answered():
    assert choose_node({}) is None
    assert choose_node({"a": None, "b": None}) is None


def test_the_node_with_the_most_room_wins():
    # Room: free and reclaimable GPUs alike (the ladder takes idle borrowed leases back).
    nodes = {"a": summary(gpus=4, free=1, reclaimable=3), "b": summary(gpus=4, free=2), "c": None}
    assert choose_node(nodes) == "a"
    # Among equal room, the most free GPUs, then the name.
    assert choose_node({"a": summary(free=1, reclaimable=1), "b": summary(free=2)}) == "b"
    assert choose_node({"b": summary(free=1), "a": summary(free=1)}) == "a"


def test_what_is_already_coming_for_a_node_is_not_room():
    # b has two GPUs free, but a claim for two waits there already: a's one free GPU is better.
    assert choose_node({"a": summary(free=1), "b": summary(free=2, pending=1, pending_gpus=2)}) == "a"
    # b's two servers hold no lease yet: their kernels will claim at their first cell.
    assert choose_node({"a": summary(free=1, servers=1), "b": summary(free=2, servers=2, without=2)}) == "a"
    # A full node where nothing can be taken back is still better than none, but worst.
    assert choose_node({"a": summary(free=0, pending=3), "b": summary(free=0, reclaimable=1)}) == "b"
    assert choose_node({"a": summary(free=1, pending=2), "b": summary(free=1, pending=1)}) == "b"


def test_among_nodes_with_room_the_fewest_servers_win():
    # As Kubernetes spreads pods: a node with room and fewer servers before one with more room.
    nodes = {"a": summary(gpus=8, free=6, servers=5), "b": summary(gpus=8, free=2, servers=1)}
    assert choose_node(nodes) == "b"
    # ... but only among nodes with room for the claim.
    assert choose_node(nodes, count=4) == "a"


def test_a_summary_of_an_older_broker_counts_a_gpu_per_waiting_claim_and_no_servers():
    old = {"node": "n", "gpus": 2, "free": 2, "reclaimable": 0, "pending": 1, "leases": 0}
    assert choose_node({"old": old, "new": summary(free=1, servers=3)}) == "old"
    assert choose_node({"old": old}, count=2) == "old"  # room 1 < 2, yet the only node with 2 GPUs


def test_a_claim_of_several_gpus_goes_where_it_fits():
    nodes = {"a": summary(gpus=8, free=1, reclaimable=0), "b": summary(gpus=2, free=2)}
    assert choose_node(nodes, count=1) == "b"  # most room among those that fit: b has 2
    nodes = {"a": summary(gpus=8, free=3, reclaimable=0, servers=2), "b": summary(gpus=8, free=0, reclaimable=2)}
    assert choose_node(nodes, count=1) == "b"  # both fit; b has fewer servers
    assert choose_node(nodes, count=3) == "a"  # only a can hold 3
    # A node with fewer GPUs than the claim is never chosen.
    assert choose_node({"a": summary(gpus=2, free=2)}, count=4) is None
    with pytest.raises(ValueError, match="at least 1"):
        choose_node(nodes, count=0)


# -- node_brokers ------------------------------------------------------------------------------
def test_node_brokers_from_a_list(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    spec = " gpu-a=http://10.0.0.5:8765/services/gpusched/ , gpu-b.example=https://h.example:9/p ,"
    assert node_brokers(spec) == [
        NodeBroker("gpu-a", "http://10.0.0.5:8765/services/gpusched/"),
        NodeBroker("gpu-b.example", "https://h.example:9/p/"),
    ]
    monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, "x=http://127.0.0.1:1/")
    assert node_brokers() == [NodeBroker("x", "http://127.0.0.1:1/")]
    monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, "")
    assert node_brokers() == []  # outside a cluster, nothing to discover


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gpu-a", "entry 1 .* is not name=url"),
        ("gpu-a=http://h:1/,=http://h:2/", "entry 2 .* is not name=url"),
        ("gpu a=http://h:1/", "is not a node name"),
        ("gpu-a=ftp://h/", "is not an http"),
        ("gpu-a=h:8765", "is not an http"),
        ("gpu-a=http://h:99999/", "bad port"),
        ("gpu-a=http://h:1/?x=1", "query or a fragment"),
        ("gpu-a=http://h:1/,gpu-a=http://h:2/", "named twice"),
    ],
)
def test_a_bad_list_is_refused_with_the_entry_named(spec, message):
    with pytest.raises(ValueError, match=message):
        node_brokers(spec)


def test_the_broker_traits(monkeypatch, capsys):
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, "gpu-node-7=http://10.0.0.7:8765/services/gpusched/")
    app = GPUBroker()
    assert app.node_name == "gpu-node-7"
    # The ledger's owner is the node, not the pod: a restarted broker pod keeps its leases.
    assert app.broker_id == "gpusched-broker@gpu-node-7"
    assert app.node_brokers.startswith("gpu-node-7=")
    with pytest.raises(TraitError, match="node_brokers: entry 1"):
        GPUBroker(config=Config({"GPUBroker": {"node_brokers": "just-a-name"}}))
    with pytest.raises(TraitError, match="node_name must not be empty"):
        GPUBroker(config=Config({"GPUBroker": {"node_name": "  "}}))
    monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, "gpu-node-7")
    assert broker_module.main([]) == 2
    assert "GPUSCHED_NODE_BROKERS: entry 1 ('gpu-node-7') is not name=url" in capsys.readouterr().err
    monkeypatch.delenv(kubernetes.ENV_NODE_BROKERS)
    assert broker_module.main(["--help-all"]) == 0
    out = capsys.readouterr().out
    assert "--GPUBroker.node_name" in out and "--GPUBroker.node_brokers" in out and "NODE_NAME" in out


# -- discovery in a cluster --------------------------------------------------------------------
def _self_signed(tmp_path):
    """A certificate for 127.0.0.1 and its key, the certificate also serving as the CA file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "api.crt", tmp_path / "api.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def pod(node, host_ip, phase="Running", created="2025-01-01T00:00:00Z", deleting=False):
    meta = {"name": f"gpusched-broker-{node}", "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-02T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": phase, "hostIP": host_ip}}


class PodsAPI(web.RequestHandler):
    """``GET /api/v1/namespaces/{ns}/pods``, as the Kubernetes API answers it (the parts read)."""

    def initialize(self, seen: list) -> None:
        self.seen = seen

    def get(self, namespace: str) -> None:
        self.seen.append((namespace, self.get_query_argument("labelSelector", None), self.request.headers.get("Authorization")))
        if self.request.headers.get("Authorization") != "Bearer sa-token":
            self.set_status(403)
            self.finish({"kind": "Status", "message": "pods is forbidden", "code": 403})
            return
        items = [
            pod("gpu-b", "10.0.0.2"),
            pod("gpu-a", "10.0.0.9", created="2025-01-01T00:00:00Z"),  # an older pod on gpu-a
            pod("gpu-a", "10.0.0.1", created="2025-01-03T00:00:00Z"),  # the newest wins
            pod("gpu-c", "10.0.0.3", phase="Pending"),
            pod("gpu-d", "10.0.0.4", deleting=True),
            pod("gpu-e", "fd00::5"),
            {"metadata": {}, "spec": {}, "status": {"phase": "Running"}},  # not scheduled yet
        ]
        self.finish({"kind": "PodList", "items": items})


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A local HTTPS "API server" and a service account directory, as a pod sees them."""
    cert, key = _self_signed(tmp_path)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("sa-token\n")
    (account / "namespace").write_text("jhub")
    (account / "ca.crt").write_bytes(cert.read_bytes())
    port = free_port()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    for name in (kubernetes.ENV_NODE_BROKERS, kubernetes.ENV_NAMESPACE, kubernetes.ENV_SELECTOR, kubernetes.ENV_PORT):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kubernetes, "SERVICE_ACCOUNT_DIR", str(account))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    seen: list = []
    app = web.Application([(r"/api/v1/namespaces/([^/]+)/pods", PodsAPI, {"seen": seen})])
    return SimpleNamespace(app=app, port=port, context=context, account=account, seen=seen)


async def _serving(cluster):
    server = HTTPServer(cluster.app, ssl_options=cluster.context)
    server.listen(cluster.port, "127.0.0.1")
    return server


def test_in_a_cluster_the_broker_pods_are_the_node_brokers(cluster, monkeypatch):
    async def scenario():
        server = await _serving(cluster)
        try:
            found = await asyncio.to_thread(node_brokers)
            assert found == [
                NodeBroker("gpu-a", "http://10.0.0.1:8765/services/gpusched/"),
                NodeBroker("gpu-b", "http://10.0.0.2:8765/services/gpusched/"),
                NodeBroker("gpu-e", "http://[fd00::5]:8765/services/gpusched/"),
            ]
            assert cluster.seen[-1] == ("jhub", "app.kubernetes.io/name=gpusched-broker", "Bearer sa-token")

            monkeypatch.setenv(kubernetes.ENV_NAMESPACE, "gpu-nodes")
            monkeypatch.setenv(kubernetes.ENV_SELECTOR, "app=broker,tier=gpu")
            monkeypatch.setenv(kubernetes.ENV_PORT, "9000")
            monkeypatch.setenv(kubernetes.ENV_PREFIX, "/")
            found = await asyncio.to_thread(node_brokers)
            assert found[0] == NodeBroker("gpu-a", "http://10.0.0.1:9000/")
            assert cluster.seen[-1][:2] == ("gpu-nodes", "app=broker,tier=gpu")

            # A list, when given, wins over discovery.
            assert await asyncio.to_thread(node_brokers, "x=http://127.0.0.1:1/") == [NodeBroker("x", "http://127.0.0.1:1/")]
        finally:
            server.stop()

    asyncio.run(scenario())


def test_discovery_says_why_it_failed(cluster, monkeypatch):
    async def scenario():
        server = await _serving(cluster)
        try:
            (cluster.account / "token").write_text("not-allowed")
            with pytest.raises(kubernetes.DiscoveryError, match="HTTP 403 .*may the service account list pods in namespace jhub"):
                await asyncio.to_thread(node_brokers)
            (cluster.account / "token").write_text("sa-token")
            # An API server whose certificate the service account's CA did not sign is not believed.
            other, _ = _self_signed(cluster.account.parent / "other")
            (cluster.account / "ca.crt").write_bytes(other.read_bytes())
            with pytest.raises(kubernetes.DiscoveryError, match="cannot list the broker pods"):
                await asyncio.to_thread(node_brokers)
            monkeypatch.setenv(kubernetes.ENV_PORT, "http")
            with pytest.raises(kubernetes.DiscoveryError, match="GPUSCHED_BROKER_PORT='http' is not a port"):
                await asyncio.to_thread(node_brokers)
        finally:
            server.stop()

    (cluster.account.parent / "other").mkdir()
    asyncio.run(scenario())
    monkeypatch.delenv(kubernetes.ENV_PORT)
    os.remove(cluster.account / "token")
    with pytest.raises(kubernetes.DiscoveryError, match="cannot read the pod's service account"):
        node_brokers()


# -- two node brokers --------------------------------------------------------------------------
class Nodes:
    """Two node brokers, ``node-a`` and ``node-b``, one simulated GPU each, sharing the service token."""

    def __init__(self, tmp_path, **traits) -> None:
        self.setups = {}
        for name in ("node-a", "node-b"):
            (tmp_path / name).mkdir()
            self.setups[name] = Setup(
                tmp_path / name, node_name=name, idle_timeout=300.0, quotas={"*": 1}, **traits
            )
        self.apps: dict[str, GPUBroker] = {}
        self.closed = False

    def spec(self, *extra: str) -> str:
        return ",".join([f"{name}={setup.url}" for name, setup in self.setups.items()] + list(extra))

    async def start(self) -> None:
        for name, setup in self.setups.items():
            app = await setup.start_broker()
            app.hub_auth.api_token = SERVICE_TOKEN  # the gpusched service's, as JUPYTERHUB_API_TOKEN
            self.apps[name] = app

    async def hold(self, node: str, user: str) -> str:
        """``user``'s kernel on ``node`` holds a GPU; its lease id."""
        client, kernels = await self.setups[node].server(user)
        granted = await client.claim(Principal(user), Claim(kernels.ids[0]))
        assert granted.status == 201, granted.lease
        return granted.lease["id"]

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            for setup in self.setups.values():
                await setup.close()


async def fetch(url: str, token: str | None = None):
    headers = {"Authorization": f"token {token}"} if token else {}
    r = await AsyncHTTPClient().fetch(HTTPRequest(url, headers=headers), raise_error=False)
    return r.code, json.loads(r.body) if r.body else None


def test_the_node_summary_is_for_admins_and_the_service(tmp_path):
    nodes = Nodes(tmp_path)

    async def scenario():
        await nodes.start()
        try:
            await nodes.hold("node-a", "alice")
            url = nodes.setups["node-a"].url + "api/gpusched/node"
            code, body = await fetch(url, "tok-root")
            assert code == 200, body
            jsonschema.validate(body, NODE_SUMMARY)
            assert (body["node"], body["gpus"], body["free"], body["reclaimable"], body["leases"]) == ("node-a", 1, 0, 0, 1)
            assert body["devices"][0]["users"] == ["alice"] and body["devices"][0]["state"] == "held"
            code, again = await fetch(url, SERVICE_TOKEN)
            assert code == 200 and again["devices"] == body["devices"]
            code, body = await fetch(url, "tok-alice")
            assert code == 403 and "hub admins and the gpusched service" in body["message"]
            code, body = await fetch(url, "tok-wrong")
            assert code == 403
            code, body = await fetch(url)
            assert code == 403 and "token is required" in body["message"]
            # The status names the node too; the broker's document lists the endpoint.
            code, status = await fetch(nodes.setups["node-a"].url + "api/gpusched/status", "tok-alice")
            assert code == 200 and status["node"] == "node-a"
            code, doc = await fetch(nodes.setups["node-a"].url + "api/gpusched/openapi.json", "tok-alice")
            assert doc["paths"]["/api/gpusched/node"] == openapi_document(broker=True)["paths"]["/api/gpusched/node"]
            assert "/api/gpusched/node" not in openapi_document()["paths"]
        finally:
            await nodes.close()

    asyncio.run(scenario())


def test_the_node_summary_counts_servers_without_a_lease_and_the_gpus_claims_wait_for(tmp_path):
    """What the spawn hook counts as already coming for a node: connected servers whose kernels
    hold no lease yet, and the GPUs of the claims waiting."""
    setup = Setup(tmp_path, node_name="node-a", simulated_devices=2)

    async def scenario():
        app = await setup.start_broker()
        try:
            await setup.server("alice")  # started, no cell run yet: no lease
            bob, bob_kernels = await setup.server("bob")
            assert (await bob.claim(Principal("bob"), Claim(bob_kernels.ids[0]))).status == 201
            await until(lambda: app.broker.node_summary("node-a")["servers"] == 2, 20, "both servers to connect")
            brief = app.broker.node_summary("node-a")
            jsonschema.validate(brief, NODE_SUMMARY)
            assert (brief["servers"], brief["servers_without_lease"], brief["pending_gpus"]) == (2, 1, 0)
            root, root_kernels = await setup.server("root")
            waiting = await root.claim(Principal("root"), Claim(root_kernels.ids[0], count=2))
            assert waiting.status == 202
            await until(lambda: app.broker.node_summary("node-a")["pending_gpus"] == 2, 20, "the claim for 2 GPUs to queue")
            brief = app.broker.node_summary("node-a")
            assert (brief["servers"], brief["servers_without_lease"], brief["pending"]) == (3, 1, 1)
        finally:
            await setup.close()

    asyncio.run(scenario())


def test_an_idle_borrowed_lease_counts_as_reclaimable(tmp_path):
    setup = Setup(tmp_path, node_name="node-a", simulated_devices=2, idle_timeout=0.3, contended_idle_timeout=30.0)

    async def scenario():
        app = await setup.start_broker()
        try:
            client, kernels = await setup.server("alice")
            assert (await client.claim(Principal("alice"), Claim(kernels.ids[0]))).status == 201
            # quota 0 for everyone: alice's lease is borrowed, and her kernel does nothing.
            await until(lambda: app.broker.node_summary("node-a")["reclaimable"] == 1, 20, "the lease to count idle")
            brief = app.broker.node_summary("node-a")
            assert (brief["gpus"], brief["free"], brief["reclaimable"], brief["leases"]) == (2, 1, 1, 1)
            assert sorted(d["state"] for d in brief["devices"]) == ["free", "reclaimable"]
            drained = app.arbiter.state.snapshot[0].uuid
            await app.arbiter.drain(Principal("root", admin=True), drained, True, "maintenance")
            assert app.broker.node_summary("node-a")["gpus"] == 1
        finally:
            await setup.close()

    asyncio.run(scenario())


# -- the spawn hooks ---------------------------------------------------------------------------
@pytest.fixture
def kubeconfig(tmp_path, monkeypatch):
    """What KubeSpawner reads at construction; nothing here ever calls that API server."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "unused"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return path


def gpu_profile(gpus: int | None = None) -> Config:
    """A GPU profile as the Zero to JupyterHub docs write it, with our hook."""
    c = Config()
    env = {
        "GPUSCHED_NODE_IP": {"valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        "JUPYTER_GPUSCHED_BROKER_URL": BROKER_URL_ENV,
        "NVIDIA_VISIBLE_DEVICES": "all",
    }
    if gpus is not None:
        env["JUPYTER_GPUSCHED_GPUS"] = str(gpus)
    c.KubeSpawner.environment = env
    c.KubeSpawner.node_affinity_preferred = [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}}
    ]
    c.KubeSpawner.modify_pod_hook = kubernetes.prefer_gpu_node
    return c


async def pod_manifest(config: Config, user: str = "bob") -> dict:
    """The pod KubeSpawner would create for ``user``: its manifest, then its modify_pod_hook (as
    ``KubeSpawner._start`` does), serialized as sent to the Kubernetes API."""
    from kubernetes_asyncio.client import ApiClient
    from kubespawner import KubeSpawner

    hub = Hub(ip="hub", port=8081)
    spawner = KubeSpawner(config=config, user=SimpleNamespace(name=user, id=2, url=f"/user/{user}/"), hub=hub)
    pod = await spawner.get_pod_manifest()
    if spawner.modify_pod_hook:
        pod = await maybe_future(spawner.modify_pod_hook(spawner, pod))
    async with ApiClient() as api:
        return api.sanitize_for_serialization(pod)


def preferred_nodes(manifest: dict) -> list:
    terms = manifest["spec"].get("affinity", {}).get("nodeAffinity", {}).get("preferredDuringSchedulingIgnoredDuringExecution", [])
    return [(t["weight"], t["preference"]["matchExpressions"]) for t in terms]


def notebook_container(manifest: dict) -> dict:
    return next(c for c in manifest["spec"]["containers"] if c["name"] == "notebook")


def preference(node: str):
    return (100, [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}])


OWN_PREFERENCE = (1, [{"key": "gpu", "operator": "Exists"}])


def test_a_gpu_pod_prefers_the_node_with_free_gpus(tmp_path, kubeconfig, monkeypatch):
    nodes = Nodes(tmp_path)
    dead = f"node-c=http://127.0.0.1:{free_port()}/services/gpusched/"

    async def scenario():
        await nodes.start()
        try:
            monkeypatch.setenv(kubernetes.ENV_TOKEN, SERVICE_TOKEN)
            monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, nodes.spec(dead))
            lease = await nodes.hold("node-a", "alice")  # node-a is full, node-b free, node-c silent

            manifest = await pod_manifest(gpu_profile())
            assert preferred_nodes(manifest) == [OWN_PREFERENCE, preference("node-b")]
            container = notebook_container(manifest)
            env = {e["name"]: e for e in container["env"]}
            assert env["JUPYTER_GPUSCHED_BROKER_URL"]["value"] == BROKER_URL_ENV
            assert env["GPUSCHED_NODE_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
            assert "nvidia.com/gpu" not in (container.get("resources", {}).get("limits") or {})

            # The other way round: node-a frees its GPU, node-b's is taken.
            await nodes.apps["node-a"].arbiter.release(Principal("alice"), lease)
            await nodes.hold("node-b", "bob")
            assert preferred_nodes(await pod_manifest(gpu_profile())) == [OWN_PREFERENCE, preference("node-a")]

            # A profile that asks for 2 GPUs: no node has 2, nothing is preferred.
            assert preferred_nodes(await pod_manifest(gpu_profile(gpus=2))) == [OWN_PREFERENCE]

            # A pod that does not join a broker is left alone.
            plain = Config()
            plain.KubeSpawner.modify_pod_hook = kubernetes.prefer_gpu_node
            manifest = await pod_manifest(plain)
            assert "affinity" not in manifest["spec"]
        finally:
            await nodes.close()

    asyncio.run(scenario())


def test_a_broker_down_fails_no_spawn(tmp_path, kubeconfig, monkeypatch, caplog):
    nodes = Nodes(tmp_path)

    async def scenario():
        await nodes.start()
        monkeypatch.setenv(kubernetes.ENV_TOKEN, SERVICE_TOKEN)
        monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, nodes.spec())
        await nodes.close()  # both node brokers stop
        without_hook = gpu_profile()
        without_hook.KubeSpawner.modify_pod_hook = None
        expected = await pod_manifest(without_hook)
        manifest = await pod_manifest(gpu_profile())
        assert preferred_nodes(manifest) == [OWN_PREFERENCE]
        assert manifest == expected
        # Without the service token nothing is asked, and nothing fails either.
        monkeypatch.delenv(kubernetes.ENV_TOKEN)
        assert await pod_manifest(gpu_profile()) == expected

    caplog.set_level("INFO")
    asyncio.run(scenario())
    silent = [r for r in caplog.records if "is not answering" in r.getMessage()]
    assert {r.getMessage().split()[4] for r in silent} == {"node-a", "node-b"}
    assert any("GPUSCHED_API_TOKEN is not set" in r.getMessage() for r in caplog.records)


def test_a_broker_that_refuses_the_token_is_not_answering(tmp_path, monkeypatch):
    nodes = Nodes(tmp_path)

    async def scenario():
        await nodes.start()
        try:
            brokers = [NodeBroker(n, s.url) for n, s in nodes.setups.items()]
            answers = await kubernetes.node_summaries(brokers, "tok-alice")  # a user's token, not the service's
            assert answers == {"node-a": None, "node-b": None}
            answers = await kubernetes.node_summaries(brokers, SERVICE_TOKEN)
            assert {n: (s["node"], s["free"]) for n, s in answers.items()} == {"node-a": ("node-a", 1), "node-b": ("node-b", 1)}
        finally:
            await nodes.close()

    asyncio.run(scenario())


def test_choose_broker_points_a_local_server_at_the_chosen_node(tmp_path, monkeypatch):
    nodes = Nodes(tmp_path)

    async def scenario():
        await nodes.start()
        try:
            monkeypatch.setenv(kubernetes.ENV_TOKEN, SERVICE_TOKEN)
            monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, nodes.spec())
            await nodes.hold("node-b", "alice")
            c = Config()
            c.Spawner.environment = {"JUPYTER_GPUSCHED_BROKER_URL": "http://unchosen/", "OTHER": "kept"}
            c.Spawner.pre_spawn_hook = kubernetes.choose_broker
            spawner = LocalProcessSpawner(config=c, user=SimpleNamespace(name="root", id=1, url="/user/root/"), hub=Hub())
            await maybe_future(spawner.run_pre_spawn_hook())
            env = spawner.get_env()
            assert env["JUPYTER_GPUSCHED_BROKER_URL"] == nodes.setups["node-a"].url
            assert env["GPUSCHED_NODE"] == "node-a" and env["OTHER"] == "kept"
            # Another spawner of the same configuration is untouched until its own hook runs.
            other = LocalProcessSpawner(config=c, user=SimpleNamespace(name="root", id=1, url="/user/root/"), hub=Hub())
            assert other.environment["JUPYTER_GPUSCHED_BROKER_URL"] == "http://unchosen/"
            await nodes.close()
            await maybe_future(other.run_pre_spawn_hook())
            assert other.environment["JUPYTER_GPUSCHED_BROKER_URL"] == "http://unchosen/"
        finally:
            await nodes.close()

    asyncio.run(scenario())


# -- DRA mode: the pod names its node's claim --------------------------------------------------------
DRA_VERSIONS = ("1.34.0", "1.35.0", "1.36.0")
OWN_REQUIRED = {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}


def dra_profile() -> Config:
    """The DRA mode's GPU profile (deploy/kubernetes/dra/z2jh-values-dra.yaml), with a required
    affinity of its own, which the node requirement must keep."""
    c = Config()
    c.KubeSpawner.environment = {
        "GPUSCHED_NODE_IP": {"valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        "JUPYTER_GPUSCHED_BROKER_URL": BROKER_URL_ENV,
    }
    c.KubeSpawner.node_affinity_required = [OWN_REQUIRED]
    c.KubeSpawner.mem_limit = "1G"
    c.KubeSpawner.modify_pod_hook = kubernetes.claim_gpu_node
    return c


def node_claim_of(manifest: dict) -> tuple[str, str, list]:
    """(the claim the pod names, the node it requires, the notebook container's claims)."""
    spec = manifest["spec"]
    (claim,) = spec["resourceClaims"]
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == OWN_REQUIRED["matchExpressions"], term  # the profile's own, kept (ANDed)
    (on_node,) = term["matchFields"]
    assert on_node["key"] == "metadata.name" and on_node["operator"] == "In"
    return claim["resourceClaimName"], on_node["values"][0], notebook_container(manifest)["resources"].get("claims")


@pytest.fixture
def kube_api(tmp_path, kubeconfig, monkeypatch):
    """The stand-in Kubernetes API (tests/kube_api.py says what it does not check), which the
    hook's claim keeper and KubeSpawner both find through KUBECONFIG."""
    from kube_api import KubeAPI

    api = KubeAPI()
    api.start()
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kubeconfig-dra", namespace="jhub")))
    monkeypatch.setenv("POD_NAMESPACE", "jhub")
    monkeypatch.delenv("GPUSCHED_DRA_DEVICE_CLASS", raising=False)
    yield api
    api.stop()


def test_in_dra_mode_the_gpu_pod_names_the_chosen_nodes_claim(tmp_path, kube_api, monkeypatch):
    import kubernetes_validate

    from jupyter_gpusched.nodeclaims import ClaimError, node_claim

    nodes = Nodes(tmp_path)

    async def scenario():
        await nodes.start()
        try:
            monkeypatch.setenv(kubernetes.ENV_TOKEN, SERVICE_TOKEN)
            monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, nodes.spec())
            lease = await nodes.hold("node-a", "alice")  # node-a is full, node-b free

            manifest = await pod_manifest(dra_profile())
            claim, node, uses = node_claim_of(manifest)
            assert (claim, node, uses) == ("gpusched-gpus-node-b", "node-b", [{"name": "gpus"}])
            assert manifest["spec"]["resourceClaims"] == [{"name": "gpus", "resourceClaimName": claim}]
            resources = notebook_container(manifest)["resources"]
            assert not any("nvidia.com/gpu" in (resources.get(k) or {}) for k in ("limits", "requests"))
            assert resources["limits"]["memory"] == 1 << 30  # the profile's resources are kept
            for version in DRA_VERSIONS:
                kubernetes_validate.validate(manifest, version, strict=True)
            # The hub created the claim for all of node-b's GPUs, in its namespace.
            assert kube_api.claim(claim, "jhub")["spec"] == node_claim("node-b")["spec"]

            # The other way round: node-a frees its GPU, node-b's is taken; node-a's claim is made
            # once, then only read.
            await nodes.apps["node-a"].arbiter.release(Principal("alice"), lease)
            await nodes.hold("node-b", "bob")
            for _ in range(2):
                claim, node, _uses = node_claim_of(await pod_manifest(dra_profile()))
                assert (claim, node) == ("gpusched-gpus-node-a", "node-a")
            assert len([p for m, p in kube_api.requests if m == "POST"]) == 2

            # node-a's claim allocated on another node (a pod placed without the hook): the spawn
            # fails, saying so, and the claim is left as it is.
            from kubernetes import client, config

            from kube_api import allocate

            configuration = client.Configuration()
            config.load_kube_config(config_file=os.environ["KUBECONFIG"], client_configuration=configuration)
            with client.ApiClient(configuration) as api_client:
                await asyncio.to_thread(allocate, api_client, "jhub", claim, "node-z", 2, "jupyter-x")
            with pytest.raises(ClaimError, match="cannot be claimed for bob's server: claim gpusched-gpus-node-a is allocated on node node-z"):
                await pod_manifest(dra_profile())
            assert kube_api.claim(claim, "jhub")["status"]["reservedFor"][0]["name"] == "jupyter-x"
            # No broker answers: no node, and the spawn fails saying why (a pod without its claim has no GPU).
            await nodes.close()
            with pytest.raises(ClaimError, match="No GPU node for bob's server: 2 node broker.*none answered.*not answering"):
                await pod_manifest(dra_profile())
            # A pod that does not join a broker is left alone, brokers or not.
            plain = Config()
            plain.KubeSpawner.modify_pod_hook = kubernetes.claim_gpu_node
            assert "resourceClaims" not in (await pod_manifest(plain))["spec"]
            assert {m for m, p in kube_api.requests if not p.endswith("/status")} == {"GET", "POST"}
        finally:
            await nodes.close()

    asyncio.run(scenario())
