"""The broker's side of the REST API: who is asking (the hub), and the broker's own endpoints.

Callers are identified with the hub (``HubAuth``): a token in the ``Authorization`` header, or
``?token=`` on websockets; never a cookie. The REST handlers themselves are the shared ones of
:mod:`jupyter_gpusched.api.handlers`; here are only the broker's own: a server's kernel ended,
metrics, the events websocket (batched) and the servers' websocket (heartbeats and orders), and
the node summary for the hub's spawn hook and the other node brokers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import uuid as uuidlib
from typing import Any

from tornado import web, websocket

from .._version import __version__
from .. import procs
from ..api import input as api_input
from ..api import routes
from ..api.handlers import APIMixin, api_handlers, arbiter_errors
from ..api.openapi import openapi_document
from ..api.input import ID_PATTERN, bad_input
from ..api.routes import HOST_HEADER, KERNEL_HEADER, PID_HEADER, PIDNS_HEADER, SERVER_HEADER
from ..api.views import Principal
from .heartbeat import HeartbeatError
from ..arbiter import LocalArbiter
from .service import Broker

log = logging.getLogger("jupyter_gpusched.broker")

#: The longest a server has to carry out a restart or shutdown order.
ORDER_TIMEOUT = 120.0
#: A host name a server may report (a pod's name is a DNS subdomain: at most 253 characters).
HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,251}[A-Za-z0-9])?")
#: The longest reason a websocket close frame carries (bytes).
CLOSE_REASON = 123


def _close_reason(text: str) -> str:
    """``text`` cut to fit a close frame (the full text goes to the log)."""
    data = text.encode()
    if len(data) <= CLOSE_REASON:
        return text
    return data[: CLOSE_REASON - 3].decode(errors="ignore") + "..."


class _Hub:
    """Identifies callers with the hub: a token (header, or ``?token=`` on websockets) only."""

    broker: Broker
    app: Any

    async def identify(self: Any) -> Principal:
        hub_auth = self.app.hub_auth
        token = hub_auth.get_token(self, in_cookie=False)
        if not token:
            raise web.HTTPError(
                403, "a JupyterHub API token is required (header 'Authorization: token ...')"
            )
        model = await hub_auth.user_for_token(token, sync=False)
        if not model:
            raise web.HTTPError(403, "this token is not valid: the hub does not know it (expired or revoked?)")
        name = model.get("name") or ""
        if model.get("kind", "user") != "user":
            name = f"service:{name}"
        scopes = hub_auth.access_scopes
        if scopes and not hub_auth.check_scopes(scopes, model):
            raise web.HTTPError(
                403,
                f"{name} may not use the GPU broker: the token lacks the scope "
                f"{sorted(scopes)[-1]} (see c.Spawner.server_token_scopes and the user role)",
            )
        self.token = token
        kernel_id = self.request.headers.get(KERNEL_HEADER) or None
        server_id = self.request.headers.get(SERVER_HEADER) or ""
        for value, what in ((kernel_id, KERNEL_HEADER), (server_id, SERVER_HEADER)):
            if value and not ID_PATTERN.match(value):
                raise web.HTTPError(400, f"{what} must be an id of letters, digits, '-' and '_'")
        return Principal(
            user=name,
            groups=tuple(g for g in model.get("groups") or () if isinstance(g, str)),
            admin=bool(model.get("admin")) and kernel_id is None,
            kernel_id=kernel_id,
            server_id=server_id,
            show_holders=self.app.show_holders,
        )


class APIHandler(_Hub, web.RequestHandler):
    """Base of the REST API: JSON in and out, errors as ``{"message", "reason"}``."""

    def initialize(self, app: Any) -> None:
        self.app = app
        self.broker = app.broker

    def check_xsrf_cookie(self) -> None:
        # Only tokens are accepted here, never cookies: there is nothing to forge.
        return None

    async def prepare(self) -> None:
        self.who = await self.identify()

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = self._reason
        if isinstance(exc, web.HTTPError) and exc.log_message:
            message = exc.log_message % exc.args
        elif status_code >= 500:
            message = "the GPU broker failed to handle this request; the admin can find why in its log"
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"message": message, "reason": self._reason}))

    # The identity hook of the API handlers (api/handlers.py).
    @property
    def scheduler(self) -> LocalArbiter:
        return self.broker.arbiter

    async def principal(self, action: str) -> Principal:
        return self.who

    def lease_url(self, lease_id: str) -> str:
        return self.app.prefix + routes.lease_path(lease_id)


class KernelEndedHandler(APIMixin, APIHandler):
    """``POST api/gpusched/kernels/{id}/ended``: a server says one of its kernels ended."""

    async def post(self, kernel_id: str) -> None:
        with bad_input():
            reason = api_input.reason(self.body()) or "the kernel was shut down"
        with arbiter_errors():
            await self.broker.kernel_ended(self.who, kernel_id, reason)
        self.set_status(204)
        self.finish()


class MetricsHandler(APIHandler):
    async def get(self) -> None:
        if not self.who.admin:
            raise web.HTTPError(403, "metrics are for hub admins")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest())


class NodeHandler(APIMixin, APIHandler):
    """``GET api/gpusched/node``: this node's GPUs, leases and queue in brief.

    For hub admins, and for the ``gpusched`` service's own token: the hub's spawn hook and the
    other node brokers, which all share it. That token is compared here with the broker's own
    (``JUPYTERHUB_API_TOKEN``) rather than sent to the hub.
    """

    is_service = False

    async def prepare(self) -> None:
        token = self.app.hub_auth.get_token(self, in_cookie=False)
        own = self.app.service_token
        if token and own and hmac.compare_digest(token.encode(), own.encode()):
            self.is_service = True
            self.who = Principal(user=f"service:{os.environ.get('JUPYTERHUB_SERVICE_NAME') or 'gpusched'}")
            return
        await super().prepare()

    async def get(self) -> None:
        if not (self.is_service or self.who.admin):
            raise web.HTTPError(
                403,
                f"{self.who.user} may not read the node summary: it is for hub admins and the gpusched "
                "service's own token",
            )
        self.reply(self.broker.node_summary(self.app.node_name))


class BrokerOpenAPIHandler(APIMixin, APIHandler):
    """``GET api/gpusched/openapi.json``: the document with the broker's own operations."""

    async def get(self) -> None:
        self.reply(openapi_document(broker=True))


class NotFoundHandler(APIHandler):
    async def prepare(self) -> None:
        raise web.HTTPError(404, f"no such endpoint: {self.request.path}")


class _Socket(_Hub, websocket.WebSocketHandler):
    """A websocket that sends events shaped for its principal."""

    def initialize(self, app: Any) -> None:
        self.app = app
        self.broker = app.broker
        self.who: Principal | None = None

    def check_xsrf_cookie(self) -> None:
        return None

    def check_origin(self, origin: str) -> bool:
        # Authenticated by token only, never by cookie: any origin may present its token.
        return True

    async def get(self, *args: Any, **kwargs: Any) -> None:
        try:
            self.who = await self.identify()
        except web.HTTPError as exc:
            self.set_status(exc.status_code)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": exc.log_message, "reason": self._reason}))
            return
        await super().get(*args, **kwargs)

    #: Whether events go to this socket (a server says so while its users watch).
    listening = True

    def send_events(self, payloads: list[str]) -> None:
        """Events, each already encoded as JSON."""
        for payload in payloads:
            self._write(payload)

    def _write(self, text: str) -> None:
        try:
            self.write_message(text)
        except websocket.WebSocketClosedError:
            self.broker.sockets.discard(self)

    def _send(self, payload: dict) -> None:
        try:
            self.write_message(json.dumps(payload))
        except websocket.WebSocketClosedError:
            self.broker.sockets.discard(self)

    def on_close(self) -> None:
        self.broker.sockets.discard(self)


class EventsSocket(_Socket):
    """``GET api/gpusched/events``: a snapshot, then lease, device and notice events."""

    async def open(self) -> None:  # type: ignore[override]
        self.broker.sockets.add(self)
        status = await self.broker.status(self.who)
        self._send({"type": "snapshot", **status})

    def on_message(self, message: Any) -> None:
        return None


class ServerSocket(_Socket):
    """``GET api/gpusched/servers/connect``: one single-user server's heartbeats and orders."""

    listening = False

    def initialize(self, app: Any) -> None:
        super().initialize(app)
        self.server_id = ""
        self._orders: dict[str, asyncio.Future] = {}

    def open(self) -> None:  # type: ignore[override]
        who = self.who
        server_id = who.server_id
        if who.kernel_id is not None or not server_id:
            self.close(4400, f"a server names itself in {SERVER_HEADER}")
            return
        headers = self.request.headers
        try:
            ns_pid = int(headers.get(PID_HEADER) or 0) or None
        except ValueError:
            ns_pid = None
        # In a container the server knows itself by the pid of its PID namespace (it may be 1);
        # in the broker's own namespace no pid below 2 is a server.
        if ns_pid is None or ns_pid < 1 or ns_pid > 2**31:
            self.close(4400, f"a server names its own process id in {PID_HEADER}")
            return
        try:
            pid_ns = int(headers.get(PIDNS_HEADER) or 0) or None
        except ValueError:
            pid_ns = -1
        if pid_ns is not None and not 0 < pid_ns < 2**64:
            self.close(4400, f"{PIDNS_HEADER} is the inode of the server's /proc/self/ns/pid, a number")
            return
        hostname = headers.get(HOST_HEADER) or None
        if hostname is not None and not HOSTNAME.fullmatch(hostname):
            self.close(4400, f"{HOST_HEADER} is a host name of letters, digits, '.' and '-'")
            return
        kernels = self.broker.kernels
        if kernels.own_namespace(pid_ns) and ns_pid <= 1:
            self.close(4400, f"a server names its own process id in {PID_HEADER}")
            return
        started: float | None
        try:
            # Everything below is checked on the broker's (host) pid of the process named.
            pid = kernels.server_process(ns_pid, pid_ns)
            if self.app.verify_server_processes:
                started = procs.check_server_process(pid, who.user, self.token)
            else:
                started = procs.started(pid)
                if started is None:
                    raise procs.NotTheirs(f"process {pid} does not run here")
        except procs.NotTheirs as exc:
            log.warning("refused a server connection of %s (server id %s): %s", who.user, server_id, exc)
            self.close(4403, _close_reason(f"refused: {exc}"))
            return
        try:
            kernels.connect(
                server_id, who.user, pid, self, pid_started=started, pid_ns=pid_ns, ns_pid=ns_pid, hostname=hostname
            )
        except PermissionError as exc:
            log.warning("refused a server connection of %s (server id %s): %s", who.user, server_id, exc)
            self.close(4403, str(exc)[:120])
            return
        self.server_id = server_id
        self.broker.sockets.add(self)
        self._send({"type": "welcome", "heartbeat_interval": self.broker.heartbeat_interval, "version": __version__})

    def on_message(self, message: Any) -> None:
        try:
            data = json.loads(message)
        except (ValueError, TypeError):
            self._send({"type": "error", "message": "messages must be JSON objects"})
            return
        if not isinstance(data, dict) or not self.server_id:
            return
        kind = data.get("type")
        if kind == "heartbeat":
            try:
                problems = self.broker.kernels.heartbeat(self.server_id, data.get("kernels"))
            except HeartbeatError as exc:
                self._send({"type": "error", "message": str(exc)})
                return
            for problem in problems:
                self._send({"type": "error", "message": problem})
        elif kind == "listen":
            self.listening = bool(data.get("on"))
        elif kind == "done":
            future = self._orders.get(str(data.get("id")))
            if future is not None and not future.done():
                future.set_result(data)
        else:
            self._send({"type": "error", "message": f"unknown message type {str(kind)[:40]!r}"})

    def send_events(self, payloads: list[str]) -> None:
        self._write('{"type": "events", "events": [' + ", ".join(payloads) + "]}")

    async def order(self, action: str, kernel_id: str) -> None:
        """Ask the server to ``action`` (restart, shutdown) one of its kernels; wait for it."""
        order_id = uuidlib.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._orders[order_id] = future
        try:
            self.write_message(json.dumps({"type": "order", "id": order_id, "action": action, "kernel_id": kernel_id}))
            result = await asyncio.wait_for(future, ORDER_TIMEOUT)
        except websocket.WebSocketClosedError:
            raise RuntimeError(f"server {self.server_id} disconnected before the {action}") from None
        finally:
            self._orders.pop(order_id, None)
        if not result.get("ok"):
            raise RuntimeError(f"server {self.server_id} could not {action} kernel {kernel_id}: {result.get('message')}")

    def on_close(self) -> None:
        super().on_close()
        if self.server_id:
            self.broker.kernels.disconnect(self.server_id, self)
        for future in self._orders.values():
            if not future.done():
                future.set_exception(RuntimeError(f"server {self.server_id} disconnected"))


def broker_handlers(app: Any) -> list[tuple]:
    """Every route of the broker under its prefix: the REST API, its websockets, metrics, the page."""
    from . import page

    p = app.prefix
    api = p + routes.API_PATH
    kw = {"app": app}
    return [
        # Before the shared routes: the broker's document lists its own operations too.
        (api + routes.OPENAPI, BrokerOpenAPIHandler, kw),
        (api + routes.NODE, NodeHandler, kw),
        *api_handlers(APIHandler, api, **kw),
        (api + routes.KERNEL_ENDED, KernelEndedHandler, kw),
        (api + routes.EVENTS, EventsSocket, kw),
        (api + routes.SERVERS_CONNECT, ServerSocket, kw),
        (p + "metrics", MetricsHandler, kw),
        (p + "oauth_callback", page.OAuthCallbackHandler, kw),
        (p.rstrip("/") + "/?", page.PageHandler, kw),
        (p + rf"admin/devices/{routes.DEVICE_UUID}/(?P<action>drain|undrain)", page.DrainFormHandler, kw),
        (p + rf"admin/leases/{routes.LEASE_ID}/release", page.ReleaseFormHandler, kw),
        (r".*", NotFoundHandler, kw),
    ]
