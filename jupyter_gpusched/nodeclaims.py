"""DRA mode: each GPU node's GPUs as one ResourceClaim that the node's GPU pods share.

With Dynamic Resource Allocation (Kubernetes 1.34 or newer, ``resource.k8s.io/v1``, and a GPU DRA
driver), Kubernetes itself counts the GPUs that JupyterHub's pods use: the hub keeps one
ResourceClaim per GPU node in its namespace (:func:`node_claim`), for all of that node's GPUs
(the driver's DeviceClass, ``allocationMode: All``). The spawn hook
(:func:`jupyter_gpusched.kubernetes.claim_gpu_node`) names the chosen node's claim in the GPU pod
and requires that node; the scheduler allocates the claim there when the first such pod is placed,
and while it is allocated the allocation itself keeps every pod that names it on that node. No
other pod gets those GPUs, and the node's broker leases them to kernels.

:class:`ClaimKeeper` keeps the claims with the official ``kubernetes`` client: it reads a node's
claim and creates it when it is missing (RBAC: ``resourceclaims`` get, list and create in the
namespace). It never deletes, replaces or patches a claim: a claim some pod uses is never taken
away by this code. A claim that cannot serve the node (allocated on another node, allocated with no
devices, asking for something else, already shared by as many pods as Kubernetes allows) or that
cannot be read or created has a ``problem`` that says why, in the words the spawn error uses.

Environment read here:

``GPUSCHED_DRA_DEVICE_CLASS``
    the DeviceClass of the GPUs (default ``gpu.nvidia.com``, the NVIDIA DRA driver's).
``POD_NAMESPACE``
    the namespace of the claims (the hub's; default: the service account's, else the kubeconfig
    context's, else ``default``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("jupyter_gpusched.nodeclaims")

ENV_DEVICE_CLASS = "GPUSCHED_DRA_DEVICE_CLASS"
ENV_NAMESPACE = "POD_NAMESPACE"
DEFAULT_DEVICE_CLASS = "gpu.nvidia.com"
#: The name of every node claim's one device request, and of the pod's claim entry.
REQUEST = "gpus"
#: A node's claim is ``gpusched-gpus-<node>`` (hashed where the node's name is too long).
PREFIX = "gpusched-gpus-"
#: Labels of every node claim (the keeper lists them by these), and the annotation naming the node.
LABELS = {"app.kubernetes.io/part-of": "jupyter-gpusched", "app.kubernetes.io/component": "node-gpus"}
NODE_ANNOTATION = "gpusched.jupyter.org/node"
#: Kubernetes keeps at most this many consumers in a claim's ``status.reservedFor``.
MAX_CONSUMERS = 256
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
#: Seconds each call to the Kubernetes API may take.
API_TIMEOUT = 5.0

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ClaimError(RuntimeError):
    """A node's claim cannot serve a GPU pod; the message says why (it becomes the spawn error)."""


def claim_name(node: str) -> str:
    """The name of ``node``'s claim: ``gpusched-gpus-<node>``, a valid object name for any node.

    A node name that would make it longer than 253 characters, or that is not a lowercase DNS
    subdomain, is replaced by a short hash of it (the claim's annotation still names the node).
    """
    name = PREFIX + node
    if len(name) <= 253 and _DNS_SUBDOMAIN.match(name):
        return name
    return PREFIX + hashlib.sha256(node.encode()).hexdigest()[:20]


def device_class() -> str:
    return os.environ.get(ENV_DEVICE_CLASS, "").strip() or DEFAULT_DEVICE_CLASS


def dra_mode() -> bool:
    """Whether this process runs in DRA mode (its DeviceClass is configured: the DRA broker
    DaemonSet and the DRA hub values set ``GPUSCHED_DRA_DEVICE_CLASS``)."""
    return bool(os.environ.get(ENV_DEVICE_CLASS, "").strip())


def claims_by_node(keeper: ClaimKeeper | None = None) -> tuple[dict[str, ClaimState], str | None]:
    """Every node claim of the namespace by node, for the admin page's cluster view, and why they
    could not be read (None: they could). Blocking: call it through ``asyncio.to_thread``."""
    try:
        states = (keeper or ClaimKeeper()).states()
    except ClaimError as exc:
        return {}, str(exc)
    except ImportError:
        return {}, "the kubernetes Python client is not installed here (pip install 'jupyter-gpusched[kubernetes]')"
    except Exception as exc:  # noqa: BLE001 - the page shows why instead of failing
        status = getattr(exc, "status", None)
        if isinstance(status, int):  # the API's answer (kubernetes.client.exceptions.ApiException)
            return {}, f"the GPU claims cannot be listed: {_message(exc)} (HTTP {status})"
        return {}, f"the GPU claims cannot be listed: {exc or type(exc).__name__}"
    return {state.node: state for state in states}, None


def node_claim(node: str, device_class_name: str | None = None) -> dict:
    """The ResourceClaim for every GPU of ``node`` (``resource.k8s.io/v1``), as the keeper creates it.

    No node is written into it: the scheduler allocates it on the node of the first pod that names
    it, and the spawn hook requires that node of every such pod.
    """
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim_name(node),
            "labels": dict(LABELS),
            "annotations": {NODE_ANNOTATION: node},
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": REQUEST,
                        "exactly": {"deviceClassName": device_class_name or device_class(), "allocationMode": "All"},
                    }
                ]
            }
        },
    }


@dataclass(frozen=True)
class ClaimState:
    """What a node's claim is: ``allocated_on`` (None: not allocated now), how many devices it
    holds and how many pods it is reserved for; ``problem`` (None: it can serve the node's pods)."""

    node: str
    name: str
    allocated_on: str | None = None
    devices: int = 0
    consumers: int = 0
    created: bool = False
    problem: str | None = None

    def describe(self) -> str:
        if self.problem:
            return self.problem
        if self.allocated_on is None:
            return f"claim {self.name}: not allocated (the next GPU pod on node {self.node} allocates it)"
        return (
            f"claim {self.name}: {self.devices} GPU(s) of node {self.allocated_on}, "
            f"shared by {self.consumers} pod(s)"
        )


def allocated_node(claim: dict) -> str | None:
    """The node a claim's allocation is on (its node selector: ``metadata.name`` or the hostname label)."""
    allocation = ((claim.get("status") or {}).get("allocation")) or {}
    terms = ((allocation.get("nodeSelector") or {}).get("nodeSelectorTerms")) or []
    for term in terms:
        for key, items in (("metadata.name", term.get("matchFields")), ("kubernetes.io/hostname", term.get("matchExpressions"))):
            for item in items or ():
                values = item.get("values") or []
                if item.get("key") == key and item.get("operator") == "In" and len(values) == 1:
                    return values[0]
    return None


def state_of(claim: dict, node: str, device_class_name: str | None = None, created: bool = False) -> ClaimState:
    """What ``claim`` (a ResourceClaim as the API answers it) is for ``node``'s GPU pods."""
    name = (claim.get("metadata") or {}).get("name") or claim_name(node)
    wanted = device_class_name or device_class()
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    exactly = [(r.get("exactly") or {}) for r in requests]
    status = claim.get("status") or {}
    allocation = status.get("allocation")
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    consumers = len(status.get("reservedFor") or [])
    on = allocated_node(claim)
    base = dict(node=node, name=name, allocated_on=on, devices=len(results), consumers=consumers, created=created)
    if len(exactly) != 1 or exactly[0].get("deviceClassName") != wanted or exactly[0].get("allocationMode") != "All":
        asks = ", ".join(f"{e.get('deviceClassName')} ({e.get('allocationMode') or 'ExactCount'})" for e in exactly) or "nothing"
        return ClaimState(**base, problem=(
            f"claim {name} asks for {asks}, not all devices of DeviceClass {wanted}: it was not made by "
            f"jupyter-gpusched, or {ENV_DEVICE_CLASS} changed since (an admin may delete it once no pod uses it)"
        ))
    if allocation:
        if on is None:
            return ClaimState(**base, problem=f"claim {name} is allocated, but not on one node (no node in its allocation)")
        if on != node:
            return ClaimState(**base, problem=(
                f"claim {name} is allocated on node {on}, not on node {node}: a pod that names it runs on {on}"
            ))
        if not results:
            return ClaimState(**base, problem=(
                f"claim {name} is allocated on node {node} with no device: the node has no GPU of DeviceClass {wanted}"
            ))
        if consumers >= MAX_CONSUMERS:
            return ClaimState(**base, problem=(
                f"claim {name} is shared by {consumers} pods, as many as Kubernetes allows: no further GPU pod fits on node {node}"
            ))
    return ClaimState(**base)


def _namespace() -> str:
    namespace = os.environ.get(ENV_NAMESPACE, "").strip()
    if namespace:
        return namespace
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        pass
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts(config_file=_kubeconfig())
        return (context or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # noqa: BLE001 - no kubeconfig: the default namespace
        return "default"


def _kubeconfig() -> str | None:
    # Read now: the client reads KUBECONFIG once, when it is imported.
    return os.environ.get("KUBECONFIG") or None


def _api() -> Any:
    """A ``ResourceV1Api`` of the official client: in a pod, its service account; else the kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ClaimError(
            "the kubernetes Python client is not installed in the hub (pip install kubernetes): "
            "it keeps the nodes' GPU claims"
        ) from None
    configuration = client.Configuration()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=_kubeconfig(), client_configuration=configuration)
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises, the spawn error says it
        raise ClaimError(f"cannot reach the Kubernetes API to keep the nodes' GPU claims: {exc}") from None
    return client.ResourceV1Api(client.ApiClient(configuration))


class ClaimKeeper:
    """Keeps each GPU node's claim in one namespace: reads it, creates it when missing, never deletes it.

    Blocking (the official client): from a coroutine, call it through ``asyncio.to_thread``.
    ``api``: a ``kubernetes.client.ResourceV1Api`` (default: :func:`_api`'s).
    """

    def __init__(self, namespace: str | None = None, device_class_name: str | None = None, api: Any = None) -> None:
        self.namespace = namespace or _namespace()
        self.device_class = device_class_name or device_class()
        self._api = api

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = _api()
        return self._api

    def ensure(self, node: str) -> ClaimState:
        """``node``'s claim, created when missing, and what it is (its ``problem`` says what is wrong).

        Raises :class:`ClaimError` when the Kubernetes API cannot be asked or refuses.
        """
        from kubernetes.client.exceptions import ApiException

        name = claim_name(node)
        created = False
        try:
            claim = self._read(name)
            if claim is None:
                try:
                    claim = self._as_dict(self.api.create_namespaced_resource_claim(
                        self.namespace, node_claim(node, self.device_class), _request_timeout=API_TIMEOUT
                    ))
                    created = True
                    log.info("created ResourceClaim %s/%s for the GPUs of node %s", self.namespace, name, node)
                except ApiException as exc:
                    if exc.status != 409:  # 409: made meanwhile by another spawn; read it
                        raise
                    claim = self._read(name)
                    if claim is None:
                        raise ClaimError(f"claim {name} was reported as existing, then not found") from None
        except ApiException as exc:
            raise ClaimError(self._refusal(exc, name)) from None
        except ClaimError:
            raise
        except Exception as exc:  # noqa: BLE001 - no connection, a timeout, a bad answer
            raise ClaimError(f"cannot keep claim {name} in namespace {self.namespace}: {exc or type(exc).__name__}") from None
        return state_of(claim, node, self.device_class, created)

    def states(self) -> list[ClaimState]:
        """Every node claim of the namespace (by the keeper's labels), sorted by node; for the admin's view."""
        selector = ",".join(f"{k}={v}" for k, v in LABELS.items())
        answer = self.api.list_namespaced_resource_claim(self.namespace, label_selector=selector, _request_timeout=API_TIMEOUT)
        out = []
        for item in self._as_dict(answer).get("items") or []:
            node = ((item.get("metadata") or {}).get("annotations") or {}).get(NODE_ANNOTATION)
            if node:
                out.append(state_of(item, node, self.device_class))
        return sorted(out, key=lambda s: s.node)

    def _read(self, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._as_dict(self.api.read_namespaced_resource_claim(name, self.namespace, _request_timeout=API_TIMEOUT))
        except ApiException as exc:
            if exc.status == 404 and _is_status(exc):
                return None  # the claim does not exist (an API that is not served answers no Status)
            raise

    def _as_dict(self, model: Any) -> dict:
        return self.api.api_client.sanitize_for_serialization(model)

    def _refusal(self, exc: Any, name: str) -> str:
        where = f"namespace {self.namespace}"
        if exc.status == 404:
            return (
                f"the Kubernetes API does not serve resource.k8s.io/v1 ResourceClaims (HTTP 404 for claim {name}): "
                "DRA mode needs Kubernetes 1.34 or newer with a GPU DRA driver; use the device-plugin mode otherwise"
            )
        if exc.status in (401, 403):
            return (
                f"the Kubernetes API refused the hub access to claim {name} in {where} (HTTP {exc.status}): may the hub's "
                "service account get, list and create resourceclaims there? (deploy/kubernetes/dra/hub-rbac.yaml)"
            )
        return f"the Kubernetes API refused claim {name} in {where}: HTTP {exc.status}: {_message(exc)}"


def _is_status(exc: Any) -> bool:
    try:
        return json.loads(exc.body or b"").get("kind") == "Status"
    except (ValueError, AttributeError):
        return False


def _message(exc: Any) -> str:
    try:
        return str(json.loads(exc.body or b"").get("message"))[:300]
    except (ValueError, AttributeError):
        return str(exc.reason or "")[:300]
