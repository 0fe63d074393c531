"""``jupyter gpusched broker``: the GPU broker of a JupyterHub (hub mode; docs/layers.md).

Run as a JupyterHub-managed service (``c.JupyterHub.services``). The broker owns the ledger and
the host's view of its GPUs and runs the same scheduling core as a standalone server; every call
is authenticated with the hub (``HubAuth``): the user, their groups and whether they are a hub
admin come from the hub, never from the caller. Each single-user server's extension is a client
(:class:`~jupyter_gpusched.arbiter.remote.BrokerClient`): it forwards its REST API here, keeps a
websocket open for heartbeats (its kernels' activity and process ids) and carries out the
restarts and shutdowns the broker orders on its own kernels.

Under the service prefix (``JUPYTERHUB_SERVICE_PREFIX``, e.g. ``/services/gpusched/``):

- ``api/gpusched/...``: the REST API of the OpenAPI document (api/openapi.py), for the caller's user.
- ``api/gpusched/servers/connect``: the servers' websocket; ``api/gpusched/kernels/{id}/ended``.
- ``/``: the admin page (hub login through OAuth): the host, every lease, the queue, unleased
  GPU processes, servers, drain and undrain. Other users see the host as the REST API shows it.
- ``metrics``: Prometheus metrics (hub admins).
- ``api/gpusched/node``: this node's GPUs, leases and queue in brief, for hub admins and the
  ``gpusched`` service itself (the hub's spawn hook and the other node brokers).

Beyond one host (JupyterHub on Kubernetes), one broker runs on each GPU node and every one acts
as the hub service ``gpusched``: ``node_name`` says which node it is, ``node_brokers`` where the
others are, for the cluster view of the admin page (:mod:`jupyter_gpusched.kubernetes`).

The service (the hub's rules and the events) is in :mod:`.service`, the handlers in
:mod:`.handlers`; this module is the application: configuration, start-up and shutdown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import ssl
import stat
import sys
from urllib.parse import urlparse

from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_unix_socket
from traitlets import Bool, Float, Int, TraitError, Unicode, default, validate
from traitlets.config import Application

from .. import kubernetes, nodeclaims, transport
from .._version import __version__
from ..arbiter.build import build_local_arbiter
from ..config import SchedulingConfig
from .handlers import broker_handlers
from .remote import RemoteKernels
from .service import Broker, BrokerPolicy, _gpu_use

DEFAULT_URL = "http://127.0.0.1:10101"
DEFAULT_PREFIX = "/services/gpusched/"
#: The largest websocket message the broker reads: a full heartbeat of the most kernels fits.
MAX_MESSAGE = 256 * 1024


class GPUBroker(SchedulingConfig, Application):
    """The GPU broker of a JupyterHub: one per host, run as a hub-managed service."""

    name = "jupyter-gpusched-broker"
    description = """The GPU broker for JupyterHub: owns the host's GPUs and the lease ledger,
    and schedules the kernels of every user's server. Run it as a JupyterHub-managed service;
    configure it with c.GPUBroker.<trait> in a config file (--config) or --GPUBroker.<trait>=."""
    version = __version__

    aliases = {
        "config": "GPUBroker.config_file",
        "log-level": "Application.log_level",
        "backend": "GPUBroker.backend",
        "ledger": "GPUBroker.ledger_path",
    }

    config_file = Unicode(
        "",
        help="""A Python config file to read c.GPUBroker.<trait> from; it may be the hub's own
        jupyterhub_config.py (everything else in it is ignored). Empty: none.""",
    ).tag(config=True)

    url = Unicode(
        help=f"""Where the broker listens; default JUPYTERHUB_SERVICE_URL, which the hub sets
        from the service's "url", else {DEFAULT_URL}.""",
    ).tag(config=True)

    unix_socket = Unicode(
        "",
        help="""A Unix domain socket the broker also listens on, for the single-user servers of this
        host (their JUPYTER_GPUSCHED_BROKER_URL is then http+unix://<this path, %-encoded><prefix>).
        Its directory must belong to the broker's user and be writable by nobody else (made, mode
        0755, when missing), so that no other user can create the socket while the broker is down
        and collect the servers' tokens; the socket itself is mode 0666 so that every user's server
        can connect. Empty: no socket (servers use url, which any local user can take over while
        it is free).""",
    ).tag(config=True)

    ssl_certfile = Unicode(
        help="""Certificate (PEM) for an https:// url. Default: JUPYTERHUB_SSL_CERTFILE (the
        hub sets it for its services when internal_ssl is on).""",
    ).tag(config=True)

    ssl_keyfile = Unicode(
        help="""Private key (PEM) for an https:// url. Default: JUPYTERHUB_SSL_KEYFILE.""",
    ).tag(config=True)

    prefix = Unicode(
        help=f"""URL path the broker's routes live under; default JUPYTERHUB_SERVICE_PREFIX (the
        hub sets it), else {DEFAULT_PREFIX}.""",
    ).tag(config=True)

    show_holders = Bool(
        False,
        help="""Show every user who holds each GPU (user names, kernel ids, notebooks). False:
        users see their own leases in full and others' as held by "another user"; hub admins
        always see everything.""",
    ).tag(config=True)

    max_pending_per_user = Int(
        4, help="Claims a user may have waiting at once; more are refused with 409. 0: no limit."
    ).tag(config=True)

    heartbeat_interval = Float(
        5.0, help="Seconds between the heartbeats each single-user server sends (the broker tells it)."
    ).tag(config=True)

    heartbeat_timeout = Float(
        30.0,
        help="""Seconds without a heartbeat after which a server counts as gone: its kernels'
        leases are released once their processes no longer hold a GPU (those left behind are
        reported on the admin page).""",
    ).tag(config=True)

    verify_server_processes = Bool(
        True,
        help="""Check that the process a single-user server names when it connects is that user's
        server: its environment must hold the very API token the connection presents (or, where
        the broker cannot read it, the process must belong to the Unix user of the hub user's
        name). Kernel processes must then descend from it. False trusts the named process (only
        for a broker that cannot see the servers' processes); reported kernels are still
        checked to descend from it.""",
    ).tag(config=True)

    max_servers_per_user = Int(
        8, help="Servers one hub user may have connected at once; more are refused. At least 1."
    ).tag(config=True)

    max_kernels_per_server = Int(
        128, help="Kernels one server may report in a heartbeat; a bigger heartbeat is refused. At least 1."
    ).tag(config=True)

    max_processes_per_kernel = Int(
        256,
        help="""Processes of one kernel's tree the broker follows (the kernel and its nearest
        descendants); GPU processes beyond them count as outside every lease. At least 1.""",
    ).tag(config=True)

    max_busy_without_gpu = Float(
        3 * 3600.0,
        help="""Seconds a server may keep saying a kernel is busy while its processes use the CPU
        but not the GPU; after that the lease can count idle. A server's word that a kernel is busy
        counts only while its processes are seen running in any case. 0: no such bound.""",
    ).tag(config=True)

    simulated_state_path = Unicode(
        "",
        help="""File where simulated GPUs record which processes use them; empty: next to the
        ledger. Every user's kernels must see the same file: set JUPYTER_GPUSCHED_SIM_STATE to
        it in c.Spawner.environment.""",
    ).tag(config=True)

    broker_id = Unicode(
        help="""The id under which the broker owns leases in the ledger; it must stay the same
        across restarts for leases to survive them. Default: gpusched-broker@<node_name>.""",
    ).tag(config=True)

    node_name = Unicode(
        help="""The name of the node (host) whose GPUs this broker schedules, as the cluster view,
        the node summary (GET api/gpusched/node) and the status show it, and as the hub's spawn hook
        prefers it (on Kubernetes: the node's name, which the node affinity matches). Default: the
        environment variable NODE_NAME (set it from the downward API, spec.nodeName), else the
        host name.""",
    ).tag(config=True)

    node_brokers = Unicode(
        help="""The GPU brokers of all the nodes, for the cluster view of the admin page:
        "name=url,name=url", each a node's name and its broker's URL with the service prefix
        (e.g. gpu-a=http://10.0.0.5:8765/services/gpusched/); this node's own entry is skipped.
        Default: the environment variable GPUSCHED_NODE_BROKERS. Empty: on Kubernetes, the broker
        pods found through the Kubernetes API (label selector GPUSCHED_BROKER_SELECTOR, port
        GPUSCHED_BROKER_PORT, prefix GPUSCHED_BROKER_PREFIX; the pod's service account must be
        allowed to list pods); elsewhere,
        no other node (the page shows this host only). The other brokers are asked with this
        broker's own API token (JUPYTERHUB_API_TOKEN), which every node broker shares; it goes only
        to the brokers listed or found, over https only once their certificate verifies
        (GPUSCHED_BROKER_CA), over plain http only to this host or to the hosts in
        GPUSCHED_BROKER_ALLOW_HTTP. A broker whose summary is not a valid node summary is shown as
        broken and never chosen.""",
    ).tag(config=True)

    #: Set by :meth:`setup` (None until then).
    arbiter = None
    broker = None
    http_server = None
    unix_server = None
    _upkeep = None
    _tcp_retry = None
    _unix_path = ""

    @default("broker_id")
    def _broker_id_default(self) -> str:
        # The node's name, not the pod's host name: a restarted broker pod finds its leases.
        return f"gpusched-broker@{self.node_name}"

    @default("node_name")
    def _node_name_default(self) -> str:
        return os.environ.get("NODE_NAME", "").strip() or socket.gethostname()

    @default("node_brokers")
    def _node_brokers_default(self) -> str:
        value = os.environ.get(kubernetes.ENV_NODE_BROKERS, "")
        try:
            kubernetes.parse_node_brokers(value)
        except ValueError as exc:
            raise TraitError(str(exc)) from None
        return value

    @validate("node_name")
    def _valid_node_name(self, proposal):
        value = proposal["value"].strip()
        if not value:
            raise TraitError("node_name must not be empty")
        return value

    @validate("node_brokers")
    def _valid_node_brokers(self, proposal):
        try:
            kubernetes.parse_node_brokers(proposal["value"], "node_brokers")
        except ValueError as exc:
            raise TraitError(str(exc)) from None
        return proposal["value"]

    @default("log_format")
    def _log_format_default(self) -> str:
        return "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"

    @default("log_datefmt")
    def _log_datefmt_default(self) -> str:
        return "%Y-%m-%d %H:%M:%S"

    @default("log_level")
    def _log_level_default(self) -> int:
        return logging.INFO

    @default("ssl_certfile")
    def _ssl_certfile_default(self) -> str:
        return os.environ.get("JUPYTERHUB_SSL_CERTFILE", "")

    @default("ssl_keyfile")
    def _ssl_keyfile_default(self) -> str:
        return os.environ.get("JUPYTERHUB_SSL_KEYFILE", "")

    @validate("unix_socket")
    def _valid_unix_socket(self, proposal):
        value = proposal["value"].strip()
        if value and not os.path.isabs(value):
            raise TraitError(f"unix_socket must be an absolute path, not {value!r}")
        if len(value.encode()) > transport.MAX_SOCKET_PATH:
            raise TraitError(f"unix_socket {value!r} is too long for a Unix socket (at most {transport.MAX_SOCKET_PATH} bytes)")
        return value

    @default("url")
    def _url_default(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_URL") or DEFAULT_URL

    @default("prefix")
    def _prefix_default(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX") or DEFAULT_PREFIX

    @validate("prefix")
    def _valid_prefix(self, proposal):
        value = "/" + proposal["value"].strip("/") + "/"
        return value.replace("//", "/")

    @validate("max_pending_per_user")
    def _valid_pending(self, proposal):
        if proposal["value"] < 0:
            raise TraitError("max_pending_per_user must be 0 (no limit) or more")
        return proposal["value"]

    @validate("max_servers_per_user", "max_kernels_per_server", "max_processes_per_kernel")
    def _at_least_one(self, proposal):
        if proposal["value"] < 1:
            raise TraitError(f"{proposal['trait'].name} must be at least 1")
        return proposal["value"]

    @validate("max_busy_without_gpu")
    def _not_negative(self, proposal):
        if proposal["value"] < 0:
            raise TraitError("max_busy_without_gpu must be 0 (no bound) or more seconds")
        return proposal["value"]

    @validate("heartbeat_interval", "heartbeat_timeout")
    def _positive(self, proposal):
        if proposal["value"] <= 0:
            raise TraitError(f"{proposal['trait'].name} must be more than 0 seconds")
        return proposal["value"]

    # -- start-up -------------------------------------------------------------------------
    def initialize(self, argv: list[str] | None = None) -> None:
        self.parse_command_line(argv)
        if self.config_file:
            path = os.path.abspath(self.config_file)
            if not os.path.isfile(path):
                raise TraitError(f"config file {path} does not exist")
            self.load_config_file(os.path.basename(path), os.path.dirname(path))
            self.update_config(self.cli_config)  # the command line wins over the file
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise TraitError("heartbeat_timeout must be longer than heartbeat_interval")
        self.node_brokers  # noqa: B018 - a malformed GPUSCHED_NODE_BROKERS stops the start here

    def _wire_logging(self) -> None:
        """The package's loggers (scheduler, ledger, devices) write where the broker's log does."""
        package_log = logging.getLogger("jupyter_gpusched")
        package_log.setLevel(self.log_level)
        for handler in self.log.handlers:
            if handler not in package_log.handlers:
                package_log.addHandler(handler)
        package_log.propagate = False

    def sched_config(self):
        return dataclasses.replace(super().sched_config(), max_pending_per_user=self.max_pending_per_user)

    def listen_address(self) -> tuple[str, int]:
        parsed = urlparse(self.url)
        if parsed.scheme not in ("http", "https", "") or not parsed.port:
            raise TraitError(f"url must be http://HOST:PORT or https://HOST:PORT, not {self.url!r}")
        return parsed.hostname or "127.0.0.1", parsed.port

    def ssl_context(self) -> ssl.SSLContext | None:
        """TLS for an https:// url (the servers verify this certificate), else None."""
        if urlparse(self.url).scheme != "https":
            return None
        if not (self.ssl_certfile and self.ssl_keyfile):
            raise TraitError(
                "url is https:// but no certificate is set: set ssl_certfile and ssl_keyfile, or turn on the "
                "hub's internal_ssl, which gives its services JUPYTERHUB_SSL_CERTFILE and JUPYTERHUB_SSL_KEYFILE"
            )
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise TraitError(f"cannot load the broker's certificate {self.ssl_certfile}: {exc}") from None
        return ctx

    def _listen_unix(self) -> None:
        """Listen on ``unix_socket``, in a directory nobody else can write (checked, or made so)."""
        path = self.unix_socket
        try:
            transport.prepare_socket_dir(path)
        except ValueError as exc:
            raise TraitError(str(exc)) from None
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise TraitError(f"unix_socket {path} exists and is not a socket; remove it or choose another path")
        sock = bind_unix_socket(path, mode=0o666)
        # Its own server: no TLS on the socket (the directory is the proof), and no proxy headers.
        self.unix_server = HTTPServer(self.web_app)
        self.unix_server.add_socket(sock)
        self._unix_path = path
        self.log.info("GPU broker: the servers of this host connect through the Unix socket %s", path)

    def _listen_tcp(self) -> bool:
        """Listen on ``url``; False when its port is taken (with a socket, the broker goes on without it)."""
        address, port = self.listen_address()
        try:
            self.http_server.listen(port, address)
        except OSError as exc:
            if not self.unix_socket:
                raise
            self.log.error(
                "GPU broker: cannot listen on %s (%s); the servers still reach the broker through %s, and the "
                "broker tries the address again every few seconds",
                self.url, exc.strerror or exc, self.unix_socket,
            )
            return False
        return True

    async def _retry_tcp(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            if self._listen_tcp():
                self.log.info("GPU broker: now listening on %s", self.url)
                return

    async def setup(self) -> None:
        """Open the inventory and the ledger, start the arbiter and listen."""
        from jupyterhub.services.auth import HubOAuth


        self.kernels = RemoteKernels(
            self.broker_id,
            heartbeat_timeout=self.heartbeat_timeout,
            launch_grace=max(60.0, 2 * self.heartbeat_timeout),
            utilization_threshold=self.idle_utilization_threshold,
            max_servers_per_user=self.max_servers_per_user,
            max_kernels_per_server=self.max_kernels_per_server,
            max_processes_per_kernel=self.max_processes_per_kernel,
            max_busy_without_gpu=self.max_busy_without_gpu or float("inf"),
        )
        if not self.verify_server_processes:
            self.log.warning(
                "verify_server_processes is off: the broker trusts the process each server names"
            )
        self.arbiter, _ = build_local_arbiter(
            self,
            kernels=self.kernels,
            log=self.log,
            simulated_state_path=self.simulated_state_path,
            mode="hub",
            show_holders=self.show_holders,
            policy=BrokerPolicy(self.kernels, node=self.node_name),
        )
        self.ledger = self.arbiter.ledger
        self.kernels.gpu_pids = lambda: {p.pid for d in self.arbiter.state.snapshot for p in d.processes}
        self.kernels.gpu_use = lambda: _gpu_use(self.arbiter.state.snapshot)
        self.broker = Broker(self.arbiter, self.kernels, heartbeat_interval=self.heartbeat_interval)
        self.hub_auth = HubOAuth(parent=self, cache_max_age=60)
        if not self.hub_auth.api_token:
            self.log.warning("JUPYTERHUB_API_TOKEN is not set: run the broker as a JupyterHub service")

        p = self.prefix
        handlers = broker_handlers(self)
        self.web_app = web.Application(
            handlers,
            cookie_secret=os.urandom(32),
            xsrf_cookies=True,
            websocket_max_message_size=MAX_MESSAGE,
            websocket_ping_interval=30,
            log_function=self._log_request,
            hub_auth=self.hub_auth,
        )
        await self.arbiter.start()
        self.http_server = HTTPServer(self.web_app, xheaders=True, ssl_options=self.ssl_context())
        if self.unix_socket:
            self._listen_unix()
        if not self._listen_tcp():
            self._tcp_retry = asyncio.create_task(self._retry_tcp())
        self._upkeep = asyncio.create_task(self._upkeep_loop())
        self.log.info(
            "GPU broker %s of node %s on %s%s: %s backend, %d GPU(s), ledger %s, policy %s",
            __version__, self.node_name, self.url.rstrip("/"), p, self.arbiter.backend_name,
            len(self.arbiter.state.snapshot), self.ledger.path, self.policy,
        )

    @property
    def service_token(self) -> str:
        """The broker's own hub API token: the ``gpusched`` service's, shared by every node broker."""
        return getattr(self.hub_auth, "api_token", None) or ""

    async def cluster(self) -> dict:
        """Every node of the cluster view: this one and the other node brokers, each with its summary.

        ``{"nodes": [{"name", "url", "this", "summary", "state", "problem"}], "error"}``: ``summary``
        is None for a broker that does not answer, answers no valid summary, or may not get the
        service token (``state`` and ``problem`` say which and why); ``error`` says why the other
        brokers could not be listed (None: they could). This node comes first, then the others by
        name.
        """
        nodes = [{"name": self.node_name, "url": None, "this": True, "summary": self.broker.node_summary(self.node_name)}]
        try:
            brokers = await asyncio.to_thread(kubernetes.node_brokers, self.node_brokers)
        except (ValueError, kubernetes.DiscoveryError) as exc:
            return {"nodes": nodes, "error": str(exc)}
        others = [b for b in brokers if b.name != self.node_name]
        reports = await kubernetes.node_reports(others, self.service_token) if others else {}
        for b in others:
            report = reports.get(b.name) or kubernetes.NodeReport(None, kubernetes.NOT_ASKED, "not asked")
            nodes.append({
                "name": b.name, "url": b.url, "this": False, "summary": report.summary,
                "state": report.state, "problem": report.problem,
            })
        out: dict = {"nodes": nodes, "error": None}
        if nodeclaims.dra_mode():
            # DRA mode: each node's GPUs are one ResourceClaim; say what each is, or why it cannot serve.
            claims, error = await asyncio.to_thread(nodeclaims.claims_by_node)
            for node in nodes:
                state = claims.get(node["name"])
                node["claim"] = (
                    {"text": state.describe(), "problem": state.problem is not None} if state is not None
                    else {"text": "no GPU claim yet: the first GPU pod placed on this node creates it", "problem": False}
                )
            out["claims_error"] = error
        return out

    async def _upkeep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.heartbeat_timeout, 10.0))
            try:
                self.kernels.prune()
                self.kernels.stranded()  # logs processes left behind once each
            except Exception:  # noqa: BLE001 - upkeep must outlive one failure
                self.log.exception("broker upkeep failed")

    def _log_request(self, handler: web.RequestHandler) -> None:
        status = handler.get_status()
        level = logging.DEBUG if status < 400 else logging.WARNING if status < 500 else logging.ERROR
        who = getattr(getattr(handler, "who", None), "user", "-")
        self.log.log(
            level, "%s %s %s (%s) %.1fms", status, handler.request.method, handler.request.path, who,
            1000.0 * handler.request.request_time(),
        )

    async def teardown(self) -> None:
        self.log.info("GPU broker stopping")
        for task in (self._upkeep, self._tcp_retry):
            if task is not None:
                task.cancel()
        server = self.http_server
        if server is not None:
            server.stop()
        if self.unix_server is not None:
            self.unix_server.stop()
        for sock in list(self.broker.sockets if self.broker else ()):
            sock.close(1001, "the GPU broker is restarting")
        if self.arbiter is not None:
            await self.arbiter.stop()
            self.arbiter.close()
        if server is not None:
            try:
                await asyncio.wait_for(server.close_all_connections(), 5)
            except asyncio.TimeoutError:
                pass
        if self.unix_server is not None:
            try:
                await asyncio.wait_for(self.unix_server.close_all_connections(), 5)
            except asyncio.TimeoutError:
                pass
        if self._unix_path:
            try:  # the next broker makes its own; a stale socket would only refuse connections
                if stat.S_ISSOCK(os.lstat(self._unix_path).st_mode):
                    os.unlink(self._unix_path)
            except OSError:
                pass

    async def serve(self) -> None:
        """Run until SIGTERM or SIGINT (the hub stops its services with either)."""
        self._wire_logging()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.setup()
            await stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self.teardown()

    def start(self) -> int:  # type: ignore[override]
        if self.show_config or self.show_config_json:
            Application.start(self)
            return 0
        asyncio.run(self.serve())
        return 0


def main(argv: list[str] | None = None) -> int:
    """``jupyter gpusched broker [--GPUBroker.<trait>=...]``; returns the exit status."""
    app = GPUBroker()
    try:
        app.initialize(argv)
    except SystemExit as exc:  # --help (0), or a bad setting traitlets already explained (2)
        return 0 if not exc.code else 2
    except (TraitError, ValueError) as exc:
        print(f"jupyter gpusched broker: error: {exc}", file=sys.stderr)
        return 2
    try:
        return app.start()
    except (TraitError, ValueError, OSError) as exc:
        app.log.error("the GPU broker could not start: %s", exc)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
