"""A stand-in for the Kubernetes API server: the ResourceClaim calls of DRA mode, over real HTTP.

No kube-apiserver can be had here, so the claim keeper (``jupyter_gpusched.nodeclaims``, which
uses the official ``kubernetes`` client) is tested against this server. It answers, as the
Kubernetes API does and in its JSON, only the calls the keeper and the tests' stand-in scheduler
make on ``resource.k8s.io/v1`` ResourceClaims in a namespace:

- ``GET .../resourceclaims`` (``labelSelector`` of ``key=value`` pairs), ``GET .../resourceclaims/{name}``
- ``POST .../resourceclaims``: stores the object, sets ``uid``, ``resourceVersion``,
  ``creationTimestamp``, ``namespace``; 409 ``AlreadyExists`` for a name taken
- ``PUT .../resourceclaims/{name}/status``: replaces the status; 409 ``Conflict`` on a stale
  ``resourceVersion``
- 404 ``NotFound`` as a ``Status`` object for a missing claim; with ``served=False`` the whole
  group answers a plain 404 (``404 page not found``), as a cluster without ``resource.k8s.io/v1``
  does; ``refuse`` maps a verb to a status (403 for RBAC)

What it does NOT check (so the tests do not show it): authentication and RBAC (only the refusals
a test asks for), the claim's schema and admission (the tests validate every claim with
``kubernetes-validate`` instead), the spec's immutability, field managers and server-side apply,
watches, the ``resource.kubernetes.io/admin-access`` namespace rule, and everything the
scheduler and the resourceclaim controller do (allocation on a node's devices, reservations,
deallocation): the tests' stand-in scheduler writes those itself. Every request is recorded in
``requests`` (method, path), so a test can say that nothing was deleted, replaced or patched.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import threading
import uuid
from pathlib import Path

from tornado import web
from tornado.httpserver import HTTPServer

GROUP = "/apis/resource.k8s.io/v1"


def status(code: int, reason: str, message: str, name: str | None = None) -> dict:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    if name:
        body["details"] = {"name": name, "group": "resource.k8s.io", "kind": "resourceclaims"}
    return body


class KubeAPI:
    """The stand-in's state: ResourceClaims by (namespace, name), the requests seen, and switches."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.served = True
        self.refuse: dict[str, int] = {}  # verb ("get", "list", "create", "update") -> HTTP status
        self.before_create = None  # called before a POST is handled (a test's race)
        self._version = 0
        self._lock = threading.Lock()
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: HTTPServer | None = None

    def next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def app(self) -> web.Application:
        return web.Application([
            (rf"{GROUP}/namespaces/([^/]+)/resourceclaims", Collection, {"api": self}),
            (rf"{GROUP}/namespaces/([^/]+)/resourceclaims/([^/]+)", Item, {"api": self}),
            (rf"{GROUP}/namespaces/([^/]+)/resourceclaims/([^/]+)/status", ItemStatus, {"api": self}),
            (r"/.*", NotServed, {"api": self}),
        ])

    # -- in a thread of its own, for other processes (a hub, its "pods") --------------------------
    def start(self) -> str:
        ready = threading.Event()

        def run() -> None:
            async def serve() -> None:
                self._server = HTTPServer(self.app())
                sockets = __import__("tornado.netutil", fromlist=["bind_sockets"]).bind_sockets(0, "127.0.0.1")
                self.port = sockets[0].getsockname()[1]
                self._server.add_sockets(sockets)
                self._loop = asyncio.get_running_loop()
                self._stopped = asyncio.Event()
                ready.set()
                await self._stopped.wait()
                self._server.stop()

            asyncio.run(serve())

        self._thread = threading.Thread(target=run, name="kube-api", daemon=True)
        self._thread.start()
        assert ready.wait(10), "the stand-in API server did not start"
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(10)
            self._loop = None

    def kubeconfig(self, path: Path, namespace: str = "jhub") -> Path:
        """A kubeconfig for this server (plain http, a token it does not check)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "hub", "user": {"token": "unchecked"}}],
            "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "hub", "namespace": namespace}}],
            "current-context": "stand-in",
        }))
        return path

    # -- what a test looks at -------------------------------------------------------------------
    def claim(self, name: str, namespace: str = "jhub") -> dict | None:
        with self._lock:
            found = self.claims.get((namespace, name))
            return copy.deepcopy(found) if found else None

    def put(self, claim: dict, namespace: str = "jhub") -> dict:
        """Store ``claim`` as if it had been created (for a test's starting state)."""
        with self._lock:
            stored = copy.deepcopy(claim)
            meta = stored.setdefault("metadata", {})
            meta.update(namespace=namespace, uid=str(uuid.uuid4()), resourceVersion=self.next_version(),
                        creationTimestamp=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
            self.claims[(namespace, meta["name"])] = stored
            return copy.deepcopy(stored)

    def verbs(self) -> set[str]:
        return {method for method, _ in self.requests}


class _Base(web.RequestHandler):
    def initialize(self, api: KubeAPI) -> None:
        self.api = api

    def prepare(self) -> None:
        self.api.requests.append((self.request.method, self.request.path))
        self.set_header("Content-Type", "application/json")
        if not self.api.served:
            self.set_status(404)
            self.set_header("Content-Type", "text/plain")
            self.finish("404 page not found\n")

    def check_xsrf_cookie(self) -> None:  # an API, not a form
        pass

    def answer(self, code: int, body: dict) -> None:
        self.set_status(code)
        self.finish(json.dumps(body))

    def refused(self, verb: str, name: str | None = None) -> bool:
        code = self.api.refuse.get(verb)
        if code is None:
            return False
        self.answer(code, status(code, "Forbidden", f'resourceclaims.resource.k8s.io is forbidden: cannot {verb} resource "resourceclaims"', name))
        return True


class NotServed(_Base):
    def prepare(self) -> None:
        self.api.requests.append((self.request.method, self.request.path))
        self.set_status(404)
        self.finish("404 page not found\n")


class Collection(_Base):
    def get(self, namespace: str) -> None:
        if self.refused("list"):
            return
        wanted = dict(p.split("=", 1) for p in (self.get_query_argument("labelSelector", "") or "").split(",") if p)
        with self.api._lock:
            items = [copy.deepcopy(c) for (ns, _), c in sorted(self.api.claims.items()) if ns == namespace
                     and wanted.items() <= (c["metadata"].get("labels") or {}).items()]
        self.answer(200, {"kind": "ResourceClaimList", "apiVersion": "resource.k8s.io/v1",
                          "metadata": {"resourceVersion": str(self.api._version)}, "items": items})

    def post(self, namespace: str) -> None:
        if self.refused("create"):
            return
        body = json.loads(self.request.body)
        name = body["metadata"]["name"]
        if self.api.before_create is not None:
            self.api.before_create()
        with self.api._lock:
            if (namespace, name) in self.api.claims:
                self.answer(409, status(409, "AlreadyExists", f'resourceclaims.resource.k8s.io "{name}" already exists', name))
                return
        self.answer(201, self.api.put(body, namespace))


class Item(_Base):
    def get(self, namespace: str, name: str) -> None:
        if self.refused("get", name):
            return
        found = self.api.claim(name, namespace)
        if found is None:
            self.answer(404, status(404, "NotFound", f'resourceclaims.resource.k8s.io "{name}" not found', name))
            return
        self.answer(200, found)


class ItemStatus(_Base):
    def put(self, namespace: str, name: str) -> None:
        if self.refused("update", name):
            return
        body = json.loads(self.request.body)
        with self.api._lock:
            stored = self.api.claims.get((namespace, name))
            if stored is None:
                self.answer(404, status(404, "NotFound", f'resourceclaims.resource.k8s.io "{name}" not found', name))
                return
            if body.get("metadata", {}).get("resourceVersion") != stored["metadata"]["resourceVersion"]:
                self.answer(409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceclaims "{name}": '
                                        "the object has been modified", name))
                return
            stored["status"] = body.get("status") or {}
            stored["metadata"]["resourceVersion"] = self.api.next_version()
            answer = copy.deepcopy(stored)
        self.answer(200, answer)


def allocate(api_client, namespace: str, name: str, node: str, devices: int, pod: str) -> dict:
    """The tests' stand-in scheduler, through the official client: reserve claim ``name`` for ``pod``,
    allocating it on ``node`` (``devices`` GPUs) when it is not allocated. Returns the claim.

    Raises ``RuntimeError`` when the claim is allocated on another node (the pod that requires
    ``node`` is unschedulable). The devices are named, not looked for: no ResourceSlice exists here.
    """
    from kubernetes import client

    resource = client.ResourceV1Api(api_client)
    for _ in range(5):
        claim = api_client.sanitize_for_serialization(resource.read_namespaced_resource_claim(name, namespace))
        state = claim.setdefault("status", {})
        allocation = state.get("allocation")
        if allocation:
            terms = allocation["nodeSelector"]["nodeSelectorTerms"]
            on = terms[0]["matchFields"][0]["values"][0]
            if on != node:
                raise RuntimeError(f"claim {name} is allocated on node {on}: a pod that requires {node} is unschedulable")
        else:
            state["allocation"] = {
                "devices": {"results": [
                    {"request": "gpus", "driver": "gpu.nvidia.com", "pool": node, "device": f"gpu-{i}"} for i in range(devices)
                ]},
                "nodeSelector": {"nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]},
            }
        reserved = [r for r in state.get("reservedFor") or [] if r["name"] != pod]
        state["reservedFor"] = [*reserved, {"resource": "pods", "name": pod, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, pod))}]
        try:
            return api_client.sanitize_for_serialization(resource.replace_namespaced_resource_claim_status(name, namespace, claim))
        except client.exceptions.ApiException as exc:
            if exc.status != 409:
                raise
    raise RuntimeError(f"claim {name}: the status could not be written")
