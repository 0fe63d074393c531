"""JupyterHub on Kubernetes: one GPU broker per node, and which node a GPU user's pod prefers.

Zero to JupyterHub runs one broker per GPU node (a DaemonSet; DESIGN section 2): each owns its
node's GPUs and ledger and answers the single-user servers of that node, and all of them act as
the one hub service ``gpusched`` (they share its API token). Kubernetes still places the pods;
this module only tells it which node would serve a GPU user best:

- :func:`node_brokers`: where the node brokers are, from a list (``GPUSCHED_NODE_BROKERS``) or,
  in the cluster, from the Kubernetes API (the broker pods of the DaemonSet).
- :func:`node_reports` (and :func:`node_summaries`): each node broker's summary (``GET
  {url}api/gpusched/node``): its GPUs, how many are free, how many idle or borrowed leases hold
  that the reclaim ladder could take back, and how many claims wait; checked against the schema
  (:func:`summary_problem`). A broker that is not asked (:class:`BrokerTrust`), does not answer
  or is broken has no summary and a reason, never an error.
- :func:`choose_node`: the best node for a claim of ``count`` GPUs (pure).
- :func:`prefer_gpu_node`: a KubeSpawner ``modify_pod_hook``: a GPU pod gets a *preferred* node
  affinity for that node (Kubernetes still decides; no broker answer, no preference).
- :func:`claim_gpu_node`: the ``modify_pod_hook`` of DRA mode: a GPU pod names the chosen node's
  ResourceClaim for all of its GPUs (kept by :mod:`jupyter_gpusched.nodeclaims`) and requires
  that node, so that Kubernetes counts the GPUs; no node or no claim fails the spawn with why.
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
``GPUSCHED_BROKER_CA``, ``GPUSCHED_BROKER_CERT``, ``GPUSCHED_BROKER_KEY``, ``GPUSCHED_BROKER_ALLOW_HTTP``
    how the node brokers are verified before the token goes to them (see :class:`BrokerTrust`).
``GPUSCHED_BROKER_SCHEME``
    ``http`` (default) or ``https``: the scheme of the brokers found in the cluster.

Whom the token goes to: only the brokers of the list, or those the Kubernetes API lists (never
an address a broker's answer names, never through a redirect); over ``https`` only when the
broker's certificate is verified; over plain ``http`` only to this host's loopback address or to
hosts the admin allowed (``GPUSCHED_BROKER_ALLOW_HTTP``). Every summary is checked against the
schema of the OpenAPI document before anything reads it: a broker that answers something else is
*broken*, shown as such on the admin page and never chosen.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterable

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from .core.nodes import choose_node
# The pod edits live in podspec.py; their names stay reachable here, where hooks and tests found them.
from .podspec import (  # noqa: F401
    AFFINITY_WEIGHT,
    ENV_BROKER_URL,
    HOSTNAME_LABEL,
    _env_of,
    _notebook_container,
    add_node_claim,
    add_preferred_node,
    is_gpu_pod,
)
from .core.nodes import count_problem as _count_problem  # noqa: F401
from .nodesummary import MAX_ITEMS, MAX_STRING, _short, summary_problem  # noqa: F401
# The trust rules live in nodetrust.py; their names stay reachable here, where callers found them.
from .nodetrust import (  # noqa: F401
    _NODE_NAME,
    ENV_ALLOW_HTTP,
    ENV_CA,
    ENV_CLIENT_CERT,
    ENV_CLIENT_KEY,
    ENV_HUB_CA,
    ENV_HUB_CERT,
    ENV_HUB_KEY,
    BrokerTrust,
    _env,
    _hub_internal_ssl,
    parse_allow_http,
)

log = logging.getLogger("jupyter_gpusched.kubernetes")

ENV_NODE_BROKERS = "GPUSCHED_NODE_BROKERS"
ENV_SELECTOR = "GPUSCHED_BROKER_SELECTOR"
ENV_PORT = "GPUSCHED_BROKER_PORT"
ENV_PREFIX = "GPUSCHED_BROKER_PREFIX"
ENV_NAMESPACE = "POD_NAMESPACE"
ENV_TOKEN = "GPUSCHED_API_TOKEN"
#: Discovery: the scheme of the broker pods' URLs (``http`` or ``https``).
ENV_SCHEME = "GPUSCHED_BROKER_SCHEME"
#: What a single-user server verifies an https:// broker with (``GPUSchedApp.broker_ca``'s default).
ENV_SERVER_CA = "JUPYTER_GPUSCHED_BROKER_CA"
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
#: Seconds the Kubernetes API has to list the broker pods.
DISCOVERY_TIMEOUT = 5.0
#: The largest node summary read (bytes); a broker that sends more is broken.
MAX_SUMMARY_BYTES = 1 << 20



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
    ``spec.nodeName``, at
    ``{GPUSCHED_BROKER_SCHEME}://{status.hostIP}:{GPUSCHED_BROKER_PORT}{GPUSCHED_BROKER_PREFIX}``
    (defaults http, 8765 and ``/services/gpusched/``). The service account must be allowed to list pods
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
    scheme = os.environ.get(ENV_SCHEME, "").strip().lower() or "http"
    if scheme not in ("http", "https"):
        raise DiscoveryError(f"{ENV_SCHEME}={scheme!r} is neither http nor https")
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
    return _brokers_of_pods(data, port, prefix, scheme)


def _brokers_of_pods(data: Any, port: int, prefix: str, scheme: str = "http") -> list[NodeBroker]:
    items = data.get("items") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise DiscoveryError("the Kubernetes API answered something that is not a pod list")
    newest: dict[str, tuple[str, NodeBroker]] = {}
    waiting: list[str] = []
    for pod in items:
        if not isinstance(pod, dict):
            continue
        meta, spec, status = (pod.get(k) if isinstance(pod.get(k), dict) else {} for k in ("metadata", "spec", "status"))
        node, host_ip = spec.get("nodeName"), status.get("hostIP")
        if status.get("phase") != "Running" or meta.get("deletionTimestamp") or not node or not host_ip:
            if status.get("phase") == "Pending" and not meta.get("deletionTimestamp"):
                waiting.append(_why_pending(meta, status))
            continue
        if not isinstance(node, str) or not _NODE_NAME.match(node) or not isinstance(host_ip, str):
            continue
        created = str(meta.get("creationTimestamp") or "")
        broker = NodeBroker(node, f"{scheme}://{_bracket(host_ip)}:{port}{prefix}")
        if node not in newest or created > newest[node][0]:
            newest[node] = (created, broker)
    _not_running[:] = waiting[:5]
    return [newest[name][1] for name in sorted(newest)]


#: Why the broker pods the last discovery found Pending wait (the scheduler's word), for the spawn error.
_not_running: list[str] = []


def _why_pending(meta: dict, status: dict) -> str:
    name = str(meta.get("name") or "a broker pod")
    for condition in status.get("conditions") or ():
        if isinstance(condition, dict) and condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return _short(f"{name}: {condition.get('reason') or 'not scheduled'}: {condition.get('message') or ''}".rstrip(": "), 300)
    return f"{name}: Pending"


def _discovery_notes() -> str:
    return "; ".join(_not_running)


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


# -- whom the service token may go to -----------------------------------------------------------
#: What asking a node broker gave (:class:`NodeReport`'s ``state``).
OK = "ok"
NOT_ANSWERING = "not answering"
BROKEN = "broken"
NOT_ASKED = "not asked"


# -- what each node broker says -----------------------------------------------------------------
@dataclass(frozen=True)
class NodeReport:
    """What asking one node broker gave: its summary, checked, or why there is none.

    ``state``: ``ok``; ``not answering`` (no connection, no answer in time, or an HTTP error,
    such as 403 for a token it does not take); ``broken`` (it answered, but not as a node broker
    does: its certificate is not verified, or its answer is not a node summary); ``not asked``
    (the token may not go there: plain http to another host that the admin did not allow, or the
    trust settings are wrong). ``problem`` says why, for the log and the admin page.
    """

    summary: dict | None
    state: str = OK
    problem: str = ""


#: The last report of each node broker (by URL), so that each change is logged once.
_reports: dict[str, NodeReport] = {}


def last_report(url: str) -> NodeReport | None:
    """The last report of the node broker at ``url`` in this process (None: never asked)."""
    return _reports.get(url)


async def node_reports(
    brokers: Iterable[NodeBroker], token: str, timeout: float = 2.0, trust: BrokerTrust | None = None
) -> dict[str, NodeReport]:
    """Each node broker's summary (``GET {url}api/gpusched/node``), asked all at once, or why not.

    ``token`` is the ``gpusched`` service's token (``Authorization: token ...``), sent only where
    ``trust`` (default: :meth:`BrokerTrust.from_environment`) lets it go. Never raises: a broker
    that is not asked, does not answer within ``timeout`` seconds, or answers something else than
    a summary has a report saying so, logged when it changes (a warning, then an info line once
    the broker answers again).
    """
    brokers = list(brokers)
    try:
        trust = BrokerTrust.from_environment() if trust is None else trust
    except ValueError as exc:
        reports = [NodeReport(None, NOT_ASKED, str(exc)) for _ in brokers]
    else:
        client = AsyncHTTPClient()
        reports = list(await asyncio.gather(*(_report_of(client, b, token, timeout, trust) for b in brokers)))
    for broker, report in zip(brokers, reports):
        _remember(broker, report)
    return {broker.name: report for broker, report in zip(brokers, reports)}


async def node_summaries(
    brokers: Iterable[NodeBroker], token: str, timeout: float = 2.0, trust: BrokerTrust | None = None
) -> dict[str, dict | None]:
    """Each node broker's checked summary, None where there is none (:func:`node_reports` says why)."""
    reports = await node_reports(brokers, token, timeout, trust)
    return {name: report.summary for name, report in reports.items()}


class _TooLarge(Exception):
    pass


async def _report_of(
    client: AsyncHTTPClient, broker: NodeBroker, token: str, timeout: float, trust: BrokerTrust
) -> NodeReport:
    refusal = trust.refusal(broker.url)
    if refusal:
        return NodeReport(None, NOT_ASKED, refusal)
    chunks: list[bytes] = []
    size = 0

    def collect(chunk: bytes) -> None:
        nonlocal size
        size += len(chunk)
        if size > MAX_SUMMARY_BYTES:
            raise _TooLarge()
        chunks.append(chunk)

    request = HTTPRequest(
        broker.url + NODE_PATH,
        headers={"Authorization": f"token {token}", "Accept": "application/json"},
        connect_timeout=timeout,
        request_timeout=timeout,
        follow_redirects=False,
        streaming_callback=collect,
        **trust.tls_options(),
    )
    too_large = NodeReport(None, BROKEN, f"it sent more than {MAX_SUMMARY_BYTES} bytes")
    try:
        response = await client.fetch(request, raise_error=False)
    except ssl.SSLError as exc:
        return NodeReport(None, BROKEN, _tls_problem(exc, trust))
    except Exception as exc:  # noqa: BLE001 - a broker that cannot be reached is only "not answering"
        if size > MAX_SUMMARY_BYTES:
            return too_large
        return NodeReport(None, NOT_ANSWERING, str(exc) or type(exc).__name__)
    if size > MAX_SUMMARY_BYTES:
        return too_large
    body = b"".join(chunks)
    if response.code == 599:
        error = response.error
        if isinstance(error, ssl.SSLError) or "certificate" in str(error).lower():
            return NodeReport(None, BROKEN, _tls_problem(error, trust))
        return NodeReport(None, NOT_ANSWERING, str(error or "no answer"))
    if response.code != 200:
        return NodeReport(None, NOT_ANSWERING, f"HTTP {response.code}: {_message(body)}")
    try:
        data = json.loads(body)
    except ValueError:
        return NodeReport(None, BROKEN, "its answer is not JSON")
    problem = summary_problem(data)
    if problem:
        return NodeReport(None, BROKEN, f"not a node summary: {problem}")
    return NodeReport(data)


def _tls_problem(exc: Any, trust: BrokerTrust) -> str:
    by = f"the CA file {trust.ca_file}" if trust.ca_file else "the system's trusted CAs"
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or exc.reason or str(exc)
        return f"its certificate is not verified by {by} ({why}); the service token was not sent"
    why = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    return f"TLS failed ({why}; certificates checked with {by}); the service token was not sent"


def _remember(broker: NodeBroker, report: NodeReport) -> None:
    before = _reports.get(broker.url)
    _reports[broker.url] = report
    if report.state != OK:
        if before is None or (before.state, before.problem) != (report.state, report.problem):
            log.warning("GPU broker of node %s (%s) is %s: %s", broker.name, broker.url, report.state, report.problem)
        return
    if before is not None and before.state != OK:
        log.info("GPU broker of node %s (%s) answers again", broker.name, broker.url)
    if report.summary is not None and report.summary.get("node") != broker.name:
        log.debug("GPU broker at %s calls its node %r, listed as %r", broker.url, report.summary.get("node"), broker.name)


def _message(body: bytes | None) -> str:
    try:
        data = json.loads(body or b"")
        return _short(str(data.get("message")), 200)
    except (ValueError, AttributeError):
        return _short((body or b"").decode("utf-8", "replace"), 200) or "no message"


async def _best_broker(count: int, logger: logging.Logger, who: str) -> tuple[NodeBroker, dict] | None:
    """The node broker to prefer for ``who``'s claim of ``count`` GPUs, with its summary (None: none)."""
    best, _ = await _choose_broker(count, logger, who)
    return best


async def _choose_broker(count: int, logger: logging.Logger, who: str) -> tuple[tuple[NodeBroker, dict] | None, str]:
    """:func:`_best_broker`'s answer, and when it is None, why (logged too)."""
    token = os.environ.get(ENV_TOKEN, "")
    if not token:
        why = f"{ENV_TOKEN} is not set (the gpusched service's token)"
        logger.warning("GPU node for %s: %s; no node preferred", who, why)
        return None, why
    try:
        trust = BrokerTrust.from_environment()
        brokers = await asyncio.to_thread(node_brokers)
    except (ValueError, DiscoveryError) as exc:
        logger.warning("GPU node for %s: %s; no node preferred", who, exc)
        return None, str(exc)
    if not brokers:
        why = f"no node brokers known (set {ENV_NODE_BROKERS}, or run the hub in the cluster)"
        waiting = _discovery_notes()
        if waiting:
            why += f"; broker pods not running: {waiting}"
        logger.warning("GPU node for %s: %s; no node preferred", who, why)
        return None, why
    reports = await node_reports(brokers, token, trust=trust)
    # Only a broker that was verified and answered a well-formed summary can be chosen.
    summaries = {name: report.summary for name, report in reports.items() if report.state == OK}
    node = choose_node(summaries, count)
    if node is None:
        answered = sum(1 for s in summaries.values() if s)
        states: dict[str, int] = {}
        for report in reports.values():
            if report.state != OK:
                states[report.state] = states.get(report.state, 0) + 1
        others = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        why = f"none of the {answered} that answered has {count} GPU(s)" if answered else "none answered"
        logger.info(
            "GPU node for %s: none preferred (%d node broker(s), %s%s)", who, len(brokers), why,
            f"; {others}" if others else "",
        )
        problems = [f"{name} {report.state}: {report.problem}" for name, report in sorted(reports.items()) if report.state != OK]
        why = f"{len(brokers)} node broker(s), {why}" + (f"; {'; '.join(problems)}" if problems else "")
        return None, _short(why, 600)
    broker = next(b for b in brokers if b.name == node)
    summary = summaries[node] or {}
    logger.info(
        "GPU node for %s: %s (%s free, %s reclaimable, %s waiting, of %s GPU(s); %s server(s), %s without a lease)",
        who, node, summary.get("free"), summary.get("reclaimable"), summary.get("pending"), summary.get("gpus"),
        summary.get("servers"), summary.get("servers_without_lease"),
    )
    return (broker, summary), ""


def _gpus_of_pod(pod: Any, logger: logging.Logger, warning: str, who: str) -> int:
    """The GPUs a GPU pod's claims ask for (its notebook container's env); ``warning`` (with the
    user's name) is logged where the container also asks for ``nvidia.com/gpu``."""
    container = _notebook_container(pod)
    limits = getattr(getattr(container, "resources", None), "limits", None) or {}
    if "nvidia.com/gpu" in limits:
        logger.warning(warning, who)
    return _gpus_wanted(_env_of(container).get(ENV_GPUS), logger)


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
        count = _gpus_of_pod(
            pod, logger, "GPU pod of %s asks for nvidia.com/gpu: those GPUs are the device plugin's, not shared by "
            "the node's GPU broker (drop the limit from the profile, and set NVIDIA_VISIBLE_DEVICES=all)", who,
        )
        best = await _best_broker(count, logger, who)
        if best is not None:
            add_preferred_node(pod, best[0].name)
    except Exception:  # noqa: BLE001 - placing a pod better is never worth failing its spawn
        logger.exception("GPU node for %s: could not choose one; the pod is left as it is", who)
    return pod


#: What the hook last found of each node's claim in this process (node -> ClaimState), for the log.
_claims: dict[str, Any] = {}


def last_claim(node: str) -> Any:
    """The state of ``node``'s claim as this process last found it (None: never asked)."""
    return _claims.get(node)


async def claim_gpu_node(spawner: Any, pod: Any) -> Any:
    """KubeSpawner ``modify_pod_hook`` for DRA mode: a GPU pod uses the chosen node's GPU claim.

    For a GPU pod (:func:`is_gpu_pod`), the node :func:`choose_node` picks from the node brokers'
    summaries, for the GPUs its ``JUPYTER_GPUSCHED_GPUS`` env asks (default 1); the hub keeps that
    node's ResourceClaim for all of its GPUs (:class:`~jupyter_gpusched.nodeclaims.ClaimKeeper`,
    created when missing) and the pod names it and requires that node (:func:`add_node_claim`),
    so Kubernetes places the pod there and counts the node's GPUs as taken. Any other pod is left
    as it is.

    Unlike :func:`prefer_gpu_node`, a GPU pod that gets no claim would have no GPU at all: when no
    node can be chosen, or the claim cannot be kept or cannot serve the node, the spawn fails with
    a :class:`~jupyter_gpusched.nodeclaims.ClaimError` that says why.

    ``c.KubeSpawner.modify_pod_hook = jupyter_gpusched.kubernetes.claim_gpu_node``
    """
    from .nodeclaims import ClaimError, ClaimKeeper

    logger = getattr(spawner, "log", None) or log
    who = _user_of(spawner)
    if not is_gpu_pod(pod):
        return pod
    count = _gpus_of_pod(
        pod, logger, "GPU pod of %s asks for nvidia.com/gpu as well as its node's GPU claim: drop the limit from the profile",
        who,
    )
    best, why = await _choose_broker(count, logger, who)
    if best is None:
        raise ClaimError(f"No GPU node for {who}'s server: {why}")
    node = best[0].name
    try:
        state = await asyncio.to_thread(ClaimKeeper().ensure, node)
    except ClaimError as exc:
        logger.error("GPU claim of node %s for %s: %s", node, who, exc)
        raise ClaimError(f"The GPUs of node {node} cannot be claimed for {who}'s server: {exc}") from None
    before = _claims.get(node)
    _claims[node] = state
    if state.problem:
        if before is None or before.problem != state.problem:
            logger.error("GPU claim of node %s: %s", node, state.problem)
        raise ClaimError(f"The GPUs of node {node} cannot be claimed for {who}'s server: {state.problem}")
    logger.info("GPU node for %s: %s, %s", who, node, state.describe())
    return add_node_claim(pod, state.name, node)


async def choose_broker(spawner: Any) -> None:
    """``pre_spawn_hook`` for spawners without Kubernetes: the server joins the best node's broker.

    Sets ``JUPYTER_GPUSCHED_BROKER_URL`` (what a single-user server reads to join a broker) to the
    broker :func:`choose_node` picks for the GPUs ``JUPYTER_GPUSCHED_GPUS`` in the spawner's
    environment asks (default 1), and ``GPUSCHED_NODE`` to its node's name. Only a listed broker
    that the trust rules let the token go to and that answered a well-formed summary is chosen
    (:class:`BrokerTrust`); for an https:// broker, ``JUPYTER_GPUSCHED_BROKER_CA`` is set to
    ``GPUSCHED_BROKER_CA`` where that is set and the environment names no CA of its own. When no
    broker answers, the environment stays as configured; a spawn never fails here.

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
            chosen = {ENV_BROKER_URL: broker.url, ENV_NODE: broker.name}
            # The server verifies an https:// broker with the CA the hub verified it with, unless
            # its environment names one of its own.
            if broker.url.startswith("https://") and _env(ENV_CA) and ENV_SERVER_CA not in environment:
                chosen[ENV_SERVER_CA] = _env(ENV_CA)
            # A new dict: the configured one may be shared with other spawners.
            spawner.environment = {**environment, **chosen}
    except Exception:  # noqa: BLE001 - as above
        logger.exception("GPU node for %s: could not choose one; the server's environment is left as it is", who)
