"""DRA mode's claim keeper (jupyter_gpusched.nodeclaims) against a server that speaks the Kubernetes API.

The keeper uses the official ``kubernetes`` client; the other side is tests/kube_api.py, a stand-in
for the API server's ResourceClaim calls over real HTTP. What the stand-in does NOT check is said
there: RBAC (only the refusals a test asks for), the claim's schema and admission (every claim the
keeper makes is validated with kubernetes-validate in test_kubernetes_manifests.py), the spec's
immutability, and all the scheduler and the resourceclaim controller do (allocation, reservation,
deallocation), which the tests' stand-in scheduler (``kube_api.allocate``) writes itself.
"""

from __future__ import annotations

import os
import pytest

from jupyter_gpusched import nodeclaims
from jupyter_gpusched.nodeclaims import ClaimError, ClaimKeeper, claim_name, node_claim

from kube_api import KubeAPI, allocate

NS = "jhub"


@pytest.fixture(scope="module")
def server():
    api = KubeAPI()
    api.start()
    yield api
    api.stop()


@pytest.fixture
def api(server, tmp_path, monkeypatch):
    """The stand-in, emptied, and the environment the hub has (its kubeconfig, its namespace)."""
    server.claims.clear()
    server.requests.clear()
    server.refuse.clear()
    server.served = True
    server.before_create = None
    monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig", namespace=NS)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv(nodeclaims.ENV_NAMESPACE, raising=False)
    monkeypatch.delenv(nodeclaims.ENV_DEVICE_CLASS, raising=False)
    return server


def scheduler():
    """The tests' stand-in scheduler's client (the official one, on the same kubeconfig)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=os.environ["KUBECONFIG"], client_configuration=configuration)
    return client.ApiClient(configuration)


def keeper_calls(api: KubeAPI) -> list[tuple[str, str]]:
    return [(m, p) for m, p in api.requests if not p.endswith("/status")]  # the stand-in scheduler's PUTs aside


def test_a_missing_claim_is_created_once_and_then_only_read(api):
    keeper = ClaimKeeper()
    assert keeper.namespace == NS  # the kubeconfig context's
    first = keeper.ensure("gpu-1")
    assert (first.name, first.created, first.allocated_on, first.problem) == ("gpusched-gpus-gpu-1", True, None, None)
    stored = api.claim("gpusched-gpus-gpu-1")
    assert stored["spec"] == node_claim("gpu-1")["spec"]
    assert stored["metadata"]["labels"] == nodeclaims.LABELS
    assert stored["metadata"]["annotations"] == {nodeclaims.NODE_ANNOTATION: "gpu-1"}
    again = keeper.ensure("gpu-1")
    assert not again.created and again.problem is None
    assert [m for m, _ in keeper_calls(api)] == ["GET", "POST", "GET"]


def test_the_claim_follows_its_allocation_and_is_never_deleted(api):
    keeper = ClaimKeeper()
    keeper.ensure("gpu-1")
    # The first pod that names it is placed on gpu-1: the scheduler allocates all 4 GPUs there.
    with scheduler() as client:
        allocate(client, NS, claim_name("gpu-1"), "gpu-1", 4, "jupyter-alice")
        allocate(client, NS, claim_name("gpu-1"), "gpu-1", 4, "jupyter-bob")
    state = keeper.ensure("gpu-1")
    assert (state.allocated_on, state.devices, state.consumers, state.problem) == ("gpu-1", 4, 2, None)
    assert "4 GPU(s) of node gpu-1, shared by 2 pod(s)" in state.describe()
    assert [s.node for s in keeper.states()] == ["gpu-1"]
    # The keeper only ever read, listed and created: no claim a pod uses was touched.
    assert {m for m, _ in keeper_calls(api)} == {"GET", "POST"}
    assert api.claim(claim_name("gpu-1"))["status"]["reservedFor"][1]["name"] == "jupyter-bob"


def test_a_claim_made_meanwhile_by_another_spawn_is_read(api):
    keeper = ClaimKeeper()

    def race():
        api.before_create = None
        api.put(node_claim("gpu-2"), NS)

    api.before_create = race
    state = keeper.ensure("gpu-2")
    assert state.problem is None and not state.created
    assert [m for m, _ in keeper_calls(api)] == ["GET", "POST", "GET"]  # 409 AlreadyExists, then read


def test_a_claim_that_cannot_serve_its_node_says_why(api):
    keeper = ClaimKeeper()
    with scheduler() as client:
        # Allocated on another node (made by hand, or a pod placed elsewhere without the hook).
        api.put(node_claim("gpu-3"), NS)
        allocate(client, NS, claim_name("gpu-3"), "gpu-9", 2, "jupyter-carol")
        # Allocated with no device: the node has no GPU of the class.
        api.put(node_claim("cpu-1"), NS)
        allocate(client, NS, claim_name("cpu-1"), "cpu-1", 0, "jupyter-dave")
    assert "allocated on node gpu-9, not on node gpu-3" in keeper.ensure("gpu-3").problem
    assert "with no device: the node has no GPU of DeviceClass gpu.nvidia.com" in keeper.ensure("cpu-1").problem
    # Asking for another class than this hub's (GPUSCHED_DRA_DEVICE_CLASS changed, or not ours).
    other = ClaimKeeper(device_class_name="gpu.example.com")
    assert "not all devices of DeviceClass gpu.example.com" in other.ensure("gpu-3").problem
    # As many consumers as Kubernetes allows.
    full = node_claim("gpu-4")
    full["status"] = {"reservedFor": [{"resource": "pods", "name": f"p{i}", "uid": str(i)} for i in range(256)]}
    full["status"]["allocation"] = {
        "devices": {"results": [{"request": "gpus", "driver": "d", "pool": "gpu-4", "device": "g0"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-4"]}]}]},
    }
    api.put(full, NS)
    assert "shared by 256 pods" in keeper.ensure("gpu-4").problem
    assert {m for m, _ in keeper_calls(api)} == {"GET"}  # nothing created over them, nothing deleted


def test_the_api_refusing_or_missing_is_a_claim_error_that_says_why(api):
    keeper = ClaimKeeper()
    api.served = False  # a cluster without resource.k8s.io/v1
    with pytest.raises(ClaimError, match="does not serve resource.k8s.io/v1 ResourceClaims .*Kubernetes 1.34"):
        keeper.ensure("gpu-1")
    api.served = True
    api.refuse["create"] = 403
    with pytest.raises(ClaimError, match="HTTP 403.*get, list and create resourceclaims.*hub-rbac.yaml"):
        keeper.ensure("gpu-1")
    api.refuse = {"get": 500}
    with pytest.raises(ClaimError, match="HTTP 500"):
        keeper.ensure("gpu-1")
    dead = ClaimKeeper(api=_unreachable_api())
    with pytest.raises(ClaimError, match="cannot keep claim gpusched-gpus-gpu-1"):
        dead.ensure("gpu-1")


def _unreachable_api():
    from kubernetes import client

    from hub_util import free_port

    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{free_port()}"
    configuration.retries = 0
    return client.ResourceV1Api(client.ApiClient(configuration))


def test_the_namespace_and_the_device_class_come_from_the_environment(api, monkeypatch):
    monkeypatch.setenv(nodeclaims.ENV_NAMESPACE, "gpu-users")
    monkeypatch.setenv(nodeclaims.ENV_DEVICE_CLASS, "gpu.example.com")
    keeper = ClaimKeeper()
    assert (keeper.namespace, keeper.device_class) == ("gpu-users", "gpu.example.com")
    keeper.ensure("gpu-1")
    stored = api.claim("gpusched-gpus-gpu-1", "gpu-users")
    assert stored["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu.example.com"


def test_the_admin_page_gets_each_nodes_claim_or_why_the_claims_cannot_be_read(api):
    from jupyter_gpusched.nodeclaims import claims_by_node

    keeper = ClaimKeeper()
    keeper.ensure("gpu-1")
    keeper.ensure("gpu-2")
    with scheduler() as client:
        allocate(client, NS, claim_name("gpu-1"), "gpu-1", 4, "jupyter-alice")
        allocate(client, NS, claim_name("gpu-2"), "gpu-9", 2, "jupyter-bob")
    claims, error = claims_by_node()
    assert error is None and set(claims) == {"gpu-1", "gpu-2"}
    assert claims["gpu-1"].problem is None and "4 GPU(s) of node gpu-1, shared by 1 pod(s)" in claims["gpu-1"].describe()
    assert "allocated on node gpu-9, not on node gpu-2" in claims["gpu-2"].describe()
    api.refuse["list"] = 403  # the brokers' Role lacks dra/broker-rbac.yaml
    claims, error = claims_by_node()
    assert claims == {} and "403" in error
    api.refuse.clear()
    api.served = False
    claims, error = claims_by_node()
    assert claims == {} and error
    assert {m for m, _ in keeper_calls(api) if m != "GET"} == {"POST"}, "the page only reads"
