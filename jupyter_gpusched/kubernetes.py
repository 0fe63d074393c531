"""JupyterHub on Kubernetes: one GPU broker per node, and which node a GPU user's pod prefers.

Zero to JupyterHub runs one broker per GPU node (a DaemonSet; DESIGN section 2): each owns its
node's GPUs and ledger and answers the single-user servers of that node, and all of them act as
the one hub service ``gpusched`` (they share its API token). Kubernetes still places the pods;
this module only tells it which node would serve a GPU user best:

- :func:`node_brokers`: where the node brokers are, from a list (``GPUSCHED_NODE_BROKERS``) or,
  in the cluster, from the Kubernetes API (the broker pods of the DaemonSet).
- :func:`node_summaries`: each node broker's summary (``GET {url}api/gpusched/node``): its GPUs,
  how many are free, how many idle or borrowed leases hold that the reclaim ladder could take
  back, and how many claims wait. A broker that does not answer is ``None``, never an error.
- :func:`choose_node`: the best node for a claim of ``count`` GPUs (pure).
- :func:`prefer_gpu_node`: a KubeSpawner ``modify_pod_hook``: a GPU pod gets a *preferred* node
  affinity for that node (Kubernetes still decides; no broker answer, no preference).
- :func:`choose_broker`: a ``pre_spawn_hook`` for spawners without Kubernetes (a local process
  per user): the server is pointed at the chosen node's broker.

The hub process needs ``GPUSCHED_API_TOKEN``: the ``gpusched`` service's API token (the one
``c.JupyterHub.services`` gives the service, and every node broker runs with as
``JUPYTERHUB_API_TOKEN``). Hub configuration::

    c.KubeSpawner.modify_pod_hook = jupyter_gpusched.kubernetes.prefer_gpu_node

Environment read here:

``GPUSCHED_NODE_BROKERS``
    ``name=url,name=url``: the node brokers, each by its node's name and its URL including the
    service prefix (as a single-user server's ``JUPYTER_GPUSCHED_BROKER_URL``), e.g.
    ``gpu-a=http://10.0.0.5:8765/services/gpusched/``. Empty: discovered in the cluster.
``GPUSCHED_BROKER_SELECTOR``, ``POD_NAMESPACE``, ``GPUSCHED_BROKER_PORT``, ``GPUSCHED_BROKER_PREFIX``
    discovery (see :func:`discover_node_brokers`).
``GPUSCHED_API_TOKEN``
    the ``gpusched`` service's token, sent to the node brokers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

log = logging.getLogger("jupyter_gpusched.kubernetes")

ENV_NODE_BROKERS = "GPUSCHED_NODE_BROKERS"
ENV_SELECTOR = "GPUSCHED_BROKER_SELECTOR"
ENV_PORT = "GPUSCHED_BROKER_PORT"
ENV_PREFIX = "GPUSCHED_BROKER_PREFIX"
ENV_NAMESPACE = "POD_NAMESPACE"
ENV_TOKEN = "GPUSCHED_API_TOKEN"
#: A single-user server joins the broker at this URL (``GPUSchedApp.broker_url``'s default).
ENV_BROKER_URL = "JUPYTER_GPUSCHED_BROKER_URL"
#: The node whose broker :func:`choose_broker` chose, for the server's environment.
ENV_NODE = "GPUSCHED_NODE"
#: GPUs a claim of this server's kernels asks for by default (the kernel side reads it too).
ENV_GPUS = "JUPYTER_GPUSCHED_GPUS"

DEFAULT_SELECTOR = "app.kubernetes.io/name=gpusched-broker"
DEFAULT_PORT = 8765
DEFAULT_PREFIX = "/services/gpusched/"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: The node summary, below a broker's URL.
NODE_PATH = "api/gpusched/node"
#: The node label the preferred affinity matches, and the weight of the preference (1-100).
HOSTNAME_LABEL = "kubernetes.io/hostname"
AFFINITY_WEIGHT = 100
#: Seconds the Kubernetes API has to list the broker pods.
DISCOVERY_TIMEOUT = 5.0

#: A Kubernetes node name (a DNS subdomain), or a host name.
_NODE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")
_SUMMARY_COUNTS = ("gpus", "free", "reclaimable", "pending", "leases")
#: Counts a broker of an earlier version does not report; checked where present.
_NEWER_COUNTS = ("pending_gpus", "servers", "servers_without_lease")


class DiscoveryError(RuntimeError):
    """The node brokers could not be listed from the Kubernetes API; the message says why."""


@dataclass(frozen=True)
class NodeBroker:
    """The GPU broker of one node: the node's name and the broker's URL (with its service prefix)."""

    name: str
    url: str


# -- where the node brokers are -----------------------------------------------------------------
def parse_node_brokers(spec: str, what: str = ENV_NODE_BROKERS) -> list[NodeBroker]:
    """``name=url,name=url`` as node brokers; ``ValueError`` naming the bad entry otherwise.

    Each URL must be ``http(s)://host[:port][/path]``; a trailing ``/`` is added. Names (the
    nodes' names) must be unique. Blank entries are skipped.
    """
    out: list[NodeBroker] = []
    seen: set[str] = set()
    example = "gpu-a=http://10.0.0.5:8765/services/gpusched/"
    for n, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, url = (part.strip() for part in entry.partition("="))
        if not sep or not name or not url:
            raise ValueError(f"{what}: entry {n} ({entry!r}) is not name=url (for example {example})")
        if not _NODE_NAME.match(name):
            raise ValueError(
                f"{what}: entry {n}: {name!r} is not a node name (letters, digits, '.', '-', '_')"
            )
        if name in seen:
            raise ValueError(f"{what}: node {name!r} is named twice")
        out.append(NodeBroker(name, _broker_url(url, f"{what}: entry {n}")))
        seen.add(name)
    return out


def _broker_url(url: str, what: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{what}: {url!r} is not an http(s)://host:port/ URL")
    if parsed.query or parsed.fragment:
        raise ValueError(f"{what}: {url!r} must not carry a query or a fragment")
    try:
        parsed.port  # noqa: B018 - a bad port raises here
    except ValueError:
        raise ValueError(f"{what}: {url!r} has a bad port") from None
    return url if url.endswith("/") else url + "/"


def in_cluster() -> bool:
    """Whether this process runs in a Kubernetes pod (the API server's address is set)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def node_brokers(spec: str | None = None) -> list[NodeBroker]:
    """The node brokers: from ``spec`` (``name=url,...``), else ``GPUSCHED_NODE_BROKERS``.

    When that is empty and this process runs in a cluster, the broker pods are listed with the
    Kubernetes API (:func:`discover_node_brokers`); outside a cluster the answer is empty.
    Blocking (it may ask the API server): from a coroutine, call it through ``asyncio.to_thread``.

    Raises:
        ValueError: a malformed list.
        DiscoveryError: the Kubernetes API could not be asked or refused.
    """
    if spec is None:
        spec = os.environ.get(ENV_NODE_BROKERS, "")
    if spec.strip():
        return parse_node_brokers(spec)
    if in_cluster():
        return discover_node_brokers()
    return []


def discover_node_brokers(service_account_dir: str | None = None) -> list[NodeBroker]:
    """The node brokers as the Kubernetes API lists them, with this pod's service account.

    The pods that match the label selector ``GPUSCHED_BROKER_SELECTOR`` (default
    ``app.kubernetes.io/name=gpusched-broker``) in the namespace ``POD_NAMESPACE`` (default: the
    service account's), running and not being deleted, one per node (the newest): named by
    ``spec.nodeName``, at ``http://{status.hostIP}:{GPUSCHED_BROKER_PORT}{GPUSCHED_BROKER_PREFIX}``
    (defaults 8765 and ``/services/gpusched/``). The service account must be allowed to list pods
    in that namespace. Sorted by node name. ``service_account_dir``: where the service account's
    token, CA certificate and namespace are (default: where Kubernetes mounts them).
    """
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    if not host:
        raise DiscoveryError("not in a Kubernetes cluster (KUBERNETES_SERVICE_HOST is not set)")
    api_port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    port = _env_port()
    prefix = "/" + os.environ.get(ENV_PREFIX, DEFAULT_PREFIX).strip("/") + "/"
    prefix = prefix.replace("//", "/")
    selector = os.environ.get(ENV_SELECTOR, "").strip() or DEFAULT_SELECTOR
    account = os.path.abspath(service_account_dir or SERVICE_ACCOUNT_DIR)
    try:
        namespace = os.environ.get(ENV_NAMESPACE, "").strip() or _read(os.path.join(account, "namespace"))
        token = _read(os.path.join(account, "token"))
        context = ssl.create_default_context(cafile=os.path.join(account, "ca.crt"))
    except (OSError, ssl.SSLError) as exc:
        raise DiscoveryError(f"cannot read the pod's service account in {account}: {exc}") from None
    api = f"https://{_bracket(host)}:{api_port}"
    url = (
        f"{api}/api/v1/namespaces/{urllib.parse.quote(namespace, safe='')}/pods?"
        + urllib.parse.urlencode({"labelSelector": selector})
    )
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    # The API server is inside the cluster: never through a proxy the environment may name.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(request, timeout=DISCOVERY_TIMEOUT) as response:
            data = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        hint = f" (may the service account list pods in namespace {namespace}?)" if exc.code in (401, 403) else ""
        raise DiscoveryError(f"the Kubernetes API at {api} refused to list the broker pods: HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DiscoveryError(f"cannot list the broker pods from the Kubernetes API at {api}: {reason}") from None
    return _brokers_of_pods(data, port, prefix)


def _brokers_of_pods(data: Any, port: int, prefix: str) -> list[NodeBroker]:
    items = data.get("items") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise DiscoveryError("the Kubernetes API answered something that is not a pod list")
    newest: dict[str, tuple[str, NodeBroker]] = {}
    for pod in items:
        if not isinstance(pod, dict):
            continue
        meta, spec, status = (pod.get(k) if isinstance(pod.get(k), dict) else {} for k in ("metadata", "spec", "status"))
        node, host_ip = spec.get("nodeName"), status.get("hostIP")
        if status.get("phase") != "Running" or meta.get("deletionTimestamp") or not node or not host_ip:
            continue
        if not isinstance(node, str) or not _NODE_NAME.match(node) or not isinstance(host_ip, str):
            continue
        created = str(meta.get("creationTimestamp") or "")
        broker = NodeBroker(node, f"http://{_bracket(host_ip)}:{port}{prefix}")
        if node not in newest or created > newest[node][0]:
            newest[node] = (created, broker)
    return [newest[name][1] for name in sorted(newest)]


def _env_port() -> int:
    text = os.environ.get(ENV_PORT, "").strip()
    if not text:
        return DEFAULT_PORT
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise DiscoveryError(f"{ENV_PORT}={text!r} is not a port number")
    return port


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


# -- what each node broker says -----------------------------------------------------------------
#: Node brokers that did not answer last time (URL -> why), so that each is logged once.
_not_answering: dict[str, str] = {}


async def node_summaries(
    brokers: Iterable[NodeBroker], token: str, timeout: float = 2.0
) -> dict[str, dict | None]:
    """Each node broker's summary (``GET {url}api/gpusched/node``), asked all at once.

    ``token`` is the ``gpusched`` service's token (``Authorization: token ...``). A broker that
    does not answer within ``timeout`` seconds, refuses or answers something else than a summary
    is ``None``; it is logged (a warning when it stops answering, then once again when it is
    back), never raised.
    """
    brokers = list(brokers)
    client = AsyncHTTPClient()
    answers = await asyncio.gather(*(_summary_of(client, b, token, timeout) for b in brokers))
    return {broker.name: answer for broker, answer in zip(brokers, answers)}


async def _summary_of(client: AsyncHTTPClient, broker: NodeBroker, token: str, timeout: float) -> dict | None:
    request = HTTPRequest(
        broker.url + NODE_PATH,
        headers={"Authorization": f"token {token}", "Accept": "application/json"},
        connect_timeout=timeout,
        request_timeout=timeout,
        follow_redirects=False,
    )
    why = ""
    summary = None
    try:
        response = await client.fetch(request, raise_error=False)
    except Exception as exc:  # noqa: BLE001 - a broker that cannot be reached is only "not answering"
        why = str(exc) or type(exc).__name__
    else:
        if response.code == 599:
            why = str(response.error or "no answer")
        elif response.code != 200:
            why = f"HTTP {response.code}: {_message(response.body)}"
        else:
            try:
                summary = _checked_summary(json.loads(response.body))
            except ValueError as exc:
                why = f"not a node summary: {exc}"
    if summary is None:
        if _not_answering.get(broker.url) != why:
            log.warning("GPU broker of node %s (%s) is not answering: %s", broker.name, broker.url, why)
        _not_answering[broker.url] = why
        return None
    if _not_answering.pop(broker.url, None) is not None:
        log.info("GPU broker of node %s (%s) answers again", broker.name, broker.url)
    if summary["node"] != broker.name:
        log.debug("GPU broker at %s calls its node %r, listed as %r", broker.url, summary["node"], broker.name)
    return summary


def _message(body: bytes | None) -> str:
    try:
        data = json.loads(body or b"")
        return str(data.get("message"))[:200]
    except (ValueError, AttributeError):
        return (body or b"").decode("utf-8", "replace")[:200] or "no message"


def _checked_summary(data: Any) -> dict:
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if not isinstance(data.get("node"), str):
        raise ValueError("no node name")
    for key in _SUMMARY_COUNTS + _NEWER_COUNTS:
        value = data.get(key)
        if value is None and key in _NEWER_COUNTS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{key} is not a count")
    return data


# -- which node --------------------------------------------------------------------------------
def choose_node(summaries: Mapping[str, dict | None], count: int = 1) -> str | None:
    """The node that would serve a claim of ``count`` GPUs best, from the node brokers' summaries.

    Pure. Only nodes whose broker answered and that have at least ``count`` schedulable GPUs
    (``gpus``) are candidates. A node's *room* is its free and reclaimable GPUs (idle or borrowed
    leases the reclaim ladder can take back) less what is already coming for them: the GPUs its
    waiting claims ask for (``pending_gpus``), and one for each connected server that holds no
    lease yet (``servers_without_lease``: kernels bind at their first cell, so a server that
    just started holds nothing but will claim soon). The best is, in this order: a node whose room
    holds the claim; then the fewest servers (as Kubernetes spreads pods that ask for the same);
    the most room; the most free GPUs; and the node name, for ties. None when no broker answered
    or no node has ``count`` GPUs. A broker too old to report ``pending_gpus`` counts one GPU per
    waiting claim, and servers as none.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    best: tuple | None = None
    for name, summary in summaries.items():
        if not summary:
            continue

        def number(key: str, default: int = 0) -> int:
            value = summary.get(key)
            return default if value is None else int(value)

        gpus, free, reclaimable = number("gpus"), number("free"), number("reclaimable")
        if gpus < count:
            continue
        coming = number("pending_gpus", number("pending")) + number("servers_without_lease")
        room = free + reclaimable - coming
        key = (room < count, number("servers"), -room, -free, name)
        if best is None or key < best:
            best = key
    return None if best is None else best[-1]


async def _best_broker(count: int, logger: logging.Logger, who: str) -> tuple[NodeBroker, dict] | None:
    """The node broker to prefer for ``who``'s claim of ``count`` GPUs, with its summary (None: none)."""
    token = os.environ.get(ENV_TOKEN, "")
    if not token:
        logger.warning("GPU node for %s: %s is not set (the gpusched service's token); no node preferred", who, ENV_TOKEN)
        return None
    try:
        brokers = await asyncio.to_thread(node_brokers)
    except (ValueError, DiscoveryError) as exc:
        logger.warning("GPU node for %s: %s; no node preferred", who, exc)
        return None
    if not brokers:
        logger.warning(
            "GPU node for %s: no node brokers known (set %s, or run the hub in the cluster); no node preferred",
            who, ENV_NODE_BROKERS,
        )
        return None
    summaries = await node_summaries(brokers, token)
    node = choose_node(summaries, count)
    if node is None:
        answered = sum(1 for s in summaries.values() if s)
        why = f"none of the {answered} that answered has {count} GPU(s)" if answered else "none answered"
        logger.info("GPU node for %s: none preferred (%d node broker(s) asked, %s)", who, len(brokers), why)
        return None
    broker = next(b for b in brokers if b.name == node)
    summary = summaries[node] or {}
    logger.info(
        "GPU node for %s: %s (%s free, %s reclaimable, %s waiting, of %s GPU(s); %s server(s), %s without a lease)",
        who, node, summary.get("free"), summary.get("reclaimable"), summary.get("pending"), summary.get("gpus"),
        summary.get("servers"), summary.get("servers_without_lease"),
    )
    return broker, summary


def _gpus_wanted(value: Any, logger: logging.Logger) -> int:
    if value is None or str(value).strip() == "":
        return 1
    try:
        count = int(str(value).strip())
    except ValueError:
        count = 0
    if count < 1:
        logger.warning("%s=%r is not a number of GPUs; a node for 1 GPU is preferred", ENV_GPUS, value)
        return 1
    return count


# -- spawner hooks -----------------------------------------------------------------------------
def _notebook_container(pod: Any) -> Any:
    containers = list(getattr(getattr(pod, "spec", None), "containers", None) or ())
    return next((c for c in containers if getattr(c, "name", None) == "notebook"), containers[0] if containers else None)


def _env_of(container: Any) -> dict[str, Any]:
    """The container's environment: name -> literal value (None for a value from elsewhere)."""
    return {e.name: e.value for e in (getattr(container, "env", None) or ()) if getattr(e, "name", None)}


def is_gpu_pod(pod: Any) -> bool:
    """Whether ``pod`` is a GPU user's: its notebook container's env sets JUPYTER_GPUSCHED_BROKER_URL.

    The notebook container is the one named ``notebook`` (KubeSpawner's), else the first. A
    profile that joins its node's broker is the one the broker's GPUs are for; every other pod
    is left alone.
    """
    container = _notebook_container(pod)
    return container is not None and ENV_BROKER_URL in _env_of(container)


def add_preferred_node(pod: Any, node: str, weight: int = AFFINITY_WEIGHT) -> Any:
    """Add a preferred node affinity for ``node`` to a KubeSpawner pod (a ``V1Pod``), keeping
    every affinity it has; returns the pod."""
    from kubernetes_asyncio.client.models import (
        V1Affinity,
        V1NodeAffinity,
        V1NodeSelectorRequirement,
        V1NodeSelectorTerm,
        V1PreferredSchedulingTerm,
    )

    spec = pod.spec
    if spec.affinity is None:
        spec.affinity = V1Affinity()
    if spec.affinity.node_affinity is None:
        spec.affinity.node_affinity = V1NodeAffinity()
    node_affinity = spec.affinity.node_affinity
    terms = list(node_affinity.preferred_during_scheduling_ignored_during_execution or ())
    terms.append(
        V1PreferredSchedulingTerm(
            weight=weight,
            preference=V1NodeSelectorTerm(
                match_expressions=[V1NodeSelectorRequirement(key=HOSTNAME_LABEL, operator="In", values=[node])]
            ),
        )
    )
    node_affinity.preferred_during_scheduling_ignored_during_execution = terms
    return pod


def _user_of(spawner: Any) -> str:
    return str(getattr(getattr(spawner, "user", None), "name", None) or "this user")


async def prefer_gpu_node(spawner: Any, pod: Any) -> Any:
    """KubeSpawner ``modify_pod_hook``: a GPU pod prefers the node that would serve it best.

    A GPU pod (:func:`is_gpu_pod`) gets a ``preferredDuringSchedulingIgnoredDuringExecution``
    node affinity (weight 100, ``kubernetes.io/hostname`` In [node]) for the node
    :func:`choose_node` picks from the node brokers' summaries, for the GPUs its
    ``JUPYTER_GPUSCHED_GPUS`` env asks (default 1). Affinities already there are kept, and
    Kubernetes still decides. Any other pod, and any failure (no token, no broker answering,
    discovery refused), leaves the pod as it is: a spawn never fails here.

    ``c.KubeSpawner.modify_pod_hook = jupyter_gpusched.kubernetes.prefer_gpu_node``
    """
    logger = getattr(spawner, "log", None) or log
    who = _user_of(spawner)
    try:
        if not is_gpu_pod(pod):
            return pod
        container = _notebook_container(pod)
        limits = getattr(getattr(container, "resources", None), "limits", None) or {}
        if "nvidia.com/gpu" in limits:
            logger.warning(
                "GPU pod of %s asks for nvidia.com/gpu: those GPUs are the device plugin's, not shared by the node's "
                "GPU broker (drop the limit from the profile, and set NVIDIA_VISIBLE_DEVICES=all)", who,
            )
        count = _gpus_wanted(_env_of(container).get(ENV_GPUS), logger)
        best = await _best_broker(count, logger, who)
        if best is not None:
            add_preferred_node(pod, best[0].name)
    except Exception:  # noqa: BLE001 - placing a pod better is never worth failing its spawn
        logger.exception("GPU node for %s: could not choose one; the pod is left as it is", who)
    return pod


async def choose_broker(spawner: Any) -> None:
    """``pre_spawn_hook`` for spawners without Kubernetes: the server joins the best node's broker.

    Sets ``JUPYTER_GPUSCHED_BROKER_URL`` (what a single-user server reads to join a broker) to the
    broker :func:`choose_node` picks for the GPUs ``JUPYTER_GPUSCHED_GPUS`` in the spawner's
    environment asks (default 1), and ``GPUSCHED_NODE`` to its node's name. When no broker
    answers, the environment stays as configured; a spawn never fails here.

    ``c.Spawner.pre_spawn_hook = jupyter_gpusched.kubernetes.choose_broker``
    """
    logger = getattr(spawner, "log", None) or log
    who = _user_of(spawner)
    try:
        environment = dict(getattr(spawner, "environment", None) or {})
        count = _gpus_wanted(environment.get(ENV_GPUS), logger)
        best = await _best_broker(count, logger, who)
        if best is not None:
            broker = best[0]
            # A new dict: the configured one may be shared with other spawners.
            spawner.environment = {**environment, ENV_BROKER_URL: broker.url, ENV_NODE: broker.name}
    except Exception:  # noqa: BLE001 - as above
        logger.exception("GPU node for %s: could not choose one; the server's environment is left as it is", who)
