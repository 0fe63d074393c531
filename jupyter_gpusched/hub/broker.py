"""``jupyter gpusched broker``: the GPU broker of a JupyterHub (hub mode, DESIGN section 2).

Run as a JupyterHub-managed service (``c.JupyterHub.services``). The broker owns the ledger and
the host's view of its GPUs and runs the same scheduling core as a standalone server; every call
is authenticated with the hub (``HubAuth``): the user, their groups and whether they are a hub
admin come from the hub, never from the caller. Each single-user server's extension is a client
(:class:`~jupyter_gpusched.hub.client.BrokerClient`): it forwards its REST API here, keeps a
websocket open for heartbeats (its kernels' activity and process ids) and carries out the
restarts and shutdowns the broker orders on its own kernels.

Under the service prefix (``JUPYTERHUB_SERVICE_PREFIX``, e.g. ``/services/gpusched/``):

- ``api/gpusched/...``: the REST API of DESIGN section 8, for the caller's user.
- ``api/gpusched/servers/connect``: the servers' websocket; ``api/gpusched/kernels/{id}/ended``.
- ``/``: the admin page (hub login through OAuth): the host, every lease, the queue, unleased
  GPU processes, servers, drain and undrain. Other users see the host as the REST API shows it.
- ``metrics``: Prometheus metrics (hub admins).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import uuid as uuidlib
from typing import Any, Awaitable, Callable
from urllib.parse import urlparse

import psutil
from tornado import web, websocket
from tornado.httpserver import HTTPServer
from traitlets import Bool, Float, Int, TraitError, Unicode, default, validate
from traitlets.config import Application

from .._version import __version__
from ..arbiter import (
    ArbiterError,
    ArbiterEvent,
    BadRequest,
    ClaimResult,
    Forbidden,
    LocalArbiter,
    NotFound,
)
from ..core import Lease
from .. import api_input, procs
from ..config import SchedulingConfig, open_inventory
from ..api_input import bad_input
from ..views import Principal, iso
from .remote import ID_PATTERN, HeartbeatError, RemoteKernels

log = logging.getLogger("jupyter_gpusched.broker")

SERVER_HEADER = "X-GPUSched-Server"
KERNEL_HEADER = "X-GPUSched-Kernel"
PID_HEADER = "X-GPUSched-Pid"
DEFAULT_URL = "http://127.0.0.1:10101"
DEFAULT_PREFIX = "/services/gpusched/"
#: Events are sent in batches at most this often (seconds); a batch has each lease's latest state.
EVENT_BATCH = 0.2
#: The largest websocket message the broker reads: a full heartbeat of the most kernels fits.
MAX_MESSAGE = 256 * 1024
#: The longest a server has to carry out a restart or shutdown order.
ORDER_TIMEOUT = 120.0
_ID = r"(?P<lease_id>[A-Za-z0-9_\-]{1,128})"
_KERNEL = r"(?P<kernel_id>[A-Za-z0-9_\-]{1,128})"
_UUID = r"(?P<uuid>[A-Za-z0-9_\-/]{1,128})"


# -- the service core -------------------------------------------------------------------------
class Broker:
    """The hub's rules around the arbiter: whose kernel is whose, who may touch which lease."""

    def __init__(self, arbiter: LocalArbiter, kernels: RemoteKernels, *, heartbeat_interval: float) -> None:
        self.arbiter = arbiter
        self.kernels = kernels
        self.heartbeat_interval = heartbeat_interval
        self.sockets: set[Any] = set()
        self.loop = asyncio.get_running_loop()
        self._pending: list[ArbiterEvent] = []
        self._flush_soon = False
        arbiter.subscribe(self._on_event)

    # reads
    async def status(self, who: Principal) -> dict:
        out = await self.arbiter.status(who)
        if who.admin:
            out["unleased_processes"] = [_with_unix_user(p) for p in out.get("unleased_processes", [])]
            out["stranded_processes"] = [_with_unix_user(p) for p in self.kernels.stranded()]
            out["servers"] = self.kernels.servers()
        return out

    def _lease(self, lease_id: str) -> Lease:
        for lease in self.arbiter.state.leases:
            if lease.id == lease_id:
                return lease
        found = self.arbiter.ledger.lease(lease_id)
        if found is None:
            raise NotFound(f"no lease {lease_id!r}")
        return found

    def _check_kernel_principal(self, who: Principal) -> None:
        if who.kernel_id is None:
            return
        owner = self.kernels.user_of(who.kernel_id)
        if owner is not None and owner != who.user:
            raise Forbidden("a kernel's token can only act for that kernel")

    def _check_owner(self, who: Principal, lease_id: str) -> Lease:
        """403 unless ``who`` may act on the lease: its own user (or that kernel), or an admin."""
        self._check_kernel_principal(who)
        lease = self._lease(lease_id)
        if who.kernel_id is not None and (lease.kernel_id != who.kernel_id or lease.user != who.user):
            raise Forbidden("a kernel's token can only act on that kernel's own lease")
        if lease.user != who.user and not who.admin:
            raise Forbidden(f"lease {lease_id} belongs to another user")
        return lease

    # writes
    async def claim(
        self,
        who: Principal,
        kernel_id: str,
        count: int | None,
        memory: int | None,
        mode: str | None,
        priority: int,
        wait: float,
    ) -> ClaimResult:
        self._check_kernel_principal(who)
        if priority > 0 and not who.admin:
            # The fair queue orders users by their share first; priority breaks ties. Users may
            # lower theirs, but raising it would let anyone jump ahead of everyone else.
            raise Forbidden("only a hub admin can raise a claim's priority above 0")
        owner = self.kernels.user_of(kernel_id)
        if owner is not None and owner != who.user:
            raise NotFound(f"no running kernel {kernel_id!r} on your servers")
        registered = False
        if not self.kernels.known(kernel_id):
            if not who.server_id:
                raise NotFound(
                    f"no running kernel {kernel_id!r} on your servers (a server that asks for a kernel "
                    f"it has not reported yet names itself in {SERVER_HEADER})"
                )
            if not self.kernels.verified_server(who.server_id, who.user):
                raise NotFound(
                    f"no running kernel {kernel_id!r} on your servers: server {who.server_id} is not "
                    "connected to the GPU broker (a server connects when it starts)"
                )
            try:
                self.kernels.register(kernel_id, who.user, who.server_id)
            except PermissionError as exc:
                raise Forbidden(str(exc)) from None
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            registered = True
        try:
            return await self.arbiter.claim(who, kernel_id, count, memory, mode, priority, wait)
        except ArbiterError:
            if registered:
                self.kernels.unregister(kernel_id)  # a refused claim leaves nothing behind
            raise

    async def release(self, who: Principal, lease_id: str) -> None:
        self._check_owner(who, lease_id)
        await self.arbiter.release(who, lease_id)

    async def keep(self, who: Principal, lease_id: str, seconds: float) -> dict:
        self._check_owner(who, lease_id)
        return await self.arbiter.keep(who, lease_id, seconds)

    async def drain(self, who: Principal, uuid: str, drained: bool, reason: str) -> dict:
        return await self.arbiter.drain(who, uuid, drained, reason)

    async def kernel_ended(self, who: Principal, kernel_id: str, reason: str) -> None:
        owner = self.kernels.user_of(kernel_id)
        leases = [le for le in self.arbiter.state.leases if le.kernel_id == kernel_id and le.live]
        if (owner is not None and owner != who.user) or any(le.user != who.user for le in leases):
            raise NotFound(f"no kernel {kernel_id!r} on your servers")
        self.kernels.ended(kernel_id, reason)
        if leases:
            await self.arbiter.kernel_ended(kernel_id, reason)
            await _replan(self.arbiter)

    # events
    def shape(self, event: ArbiterEvent, who: Principal, ctx: Any = None) -> dict | None:
        """``event`` as ``who`` may see it (None: not for them)."""
        if event.type == "lease" and event.lease is not None:
            return {"type": "lease", "lease": self.arbiter.render_lease(event.lease, who, ctx)}
        if event.type == "device" and event.device is not None:
            return {"type": "device", "device": self.arbiter.render_device(event.device, who, ctx)}
        if event.type == "notice" and event.notice is not None:
            notice = dict(event.notice)
            if notice.get("user") != who.user:
                return None  # notices are personal: they name the kernel
            if notice.get("reclaim_at") is not None:
                notice["reclaim_at"] = iso(notice["reclaim_at"])
            return {"type": "notice", **notice}
        return None

    def _on_event(self, event: ArbiterEvent) -> None:
        # The arbiter publishes some events from its worker threads; websockets live on the loop.
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self._queue(event)
        else:
            self.loop.call_soon_threadsafe(self._queue, event)

    def _queue(self, event: ArbiterEvent) -> None:
        """Events go out in batches, at most every ``EVENT_BATCH`` seconds, each lease's latest only."""
        self._pending.append(event)
        if not self._flush_soon:
            self._flush_soon = True
            self.loop.call_later(EVENT_BATCH, self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        events, self._pending = _latest(self._pending), []
        listeners = [sock for sock in list(self.sockets) if sock.listening]
        if not events or not listeners:
            return
        make_ctx = getattr(self.arbiter, "_ctx", None)
        ctx = make_ctx() if make_ctx is not None else None
        # Most viewers see a lease the same way (anonymous, not theirs): shape it once for them.
        cache: dict[tuple, str | None] = {}
        for sock in listeners:
            who = sock.who
            payloads: list[str] = []
            for n, event in enumerate(events):
                key: tuple
                if event.lease is not None:
                    key = (n, who.sees(event.lease), event.lease.user == who.user)
                elif event.device is not None:
                    key = (n, "*" if who.show_holders or who.admin else who.user)
                else:
                    key = (n, who.user)
                if key not in cache:
                    try:
                        shaped = self.shape(event, who, ctx)
                    except Exception:  # noqa: BLE001 - one bad rendering must not stop the others
                        log.exception("could not shape a %s event for %s", event.type, who.user)
                        shaped = None
                    cache[key] = json.dumps(shaped) if shaped is not None else None
                if cache[key] is not None:
                    payloads.append(cache[key])
            if payloads:
                sock.send_events(payloads)


def _latest(events: list[ArbiterEvent]) -> list[ArbiterEvent]:
    """The events of a batch, with only the last state of each lease and each device."""
    last: dict[tuple, int] = {}
    for n, event in enumerate(events):
        if event.lease is not None:
            last[("lease", event.lease.id)] = n
        elif event.device is not None:
            last[("device", event.device.uuid)] = n
    return [
        event
        for n, event in enumerate(events)
        if (event.lease is None and event.device is None)
        or last[("lease", event.lease.id) if event.lease is not None else ("device", event.device.uuid)] == n
    ]


async def _replan(arbiter: LocalArbiter) -> None:
    replan = getattr(arbiter, "replan", None)
    await (replan() if replan is not None else arbiter.tick())


def _gpu_use(snapshot) -> dict[int, float | None]:
    """GPU utilization by process (percent; None where the driver does not say).

    Where per-process figures are missing, a process alone on its GPU is given the device's.
    """
    out: dict[int, float | None] = {}
    for device in snapshot:
        alone = len(device.processes) == 1
        for proc in device.processes:
            util = proc.utilization
            if util is None and alone:
                util = device.utilization
            if util is not None or proc.pid not in out:
                out[proc.pid] = max(util, out.get(proc.pid) or 0.0) if util is not None else out.get(proc.pid)
    return out


def _with_unix_user(item: dict) -> dict:
    out = dict(item)
    try:
        out["unix_user"] = psutil.Process(int(item["pid"])).username()
    except (psutil.Error, KeyError, ValueError, TypeError):
        out["unix_user"] = None
    return out


# -- handlers ---------------------------------------------------------------------------------
class _Hub:
    """Identifies callers with the hub: a token (header, or ``?token=`` on websockets) only."""

    broker: Broker
    app: GPUBroker

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

    def initialize(self, app: GPUBroker) -> None:
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

    async def run(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await fn()
        except ArbiterError as exc:
            raise web.HTTPError(exc.status, exc.message.replace("%", "%%"), reason=exc.reason) from None

    def body(self) -> dict:
        with bad_input():
            return api_input.json_object(self.request.body)

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))


class StatusHandler(APIHandler):
    async def get(self) -> None:
        self.reply(await self.run(lambda: self.broker.status(self.who)))


class DevicesHandler(APIHandler):
    async def get(self) -> None:
        self.reply(await self.run(lambda: self.broker.arbiter.devices(self.who)))


class LeasesHandler(APIHandler):
    async def get(self) -> None:
        kernel_id = self.get_argument("kernel_id", None)
        who = self.who
        if who.kernel_id is not None and kernel_id not in (None, who.kernel_id):
            raise web.HTTPError(403, "a kernel's token can only list that kernel's own lease")
        self.reply(await self.run(lambda: self.broker.arbiter.leases(who, kernel_id or who.kernel_id)))

    async def post(self) -> None:
        with bad_input():
            req = api_input.claim(self.body())
        result = await self.run(
            lambda: self.broker.claim(self.who, req.kernel_id, req.count, req.memory, req.mode, req.priority, req.wait)
        )
        if result.status == 201:
            self.set_header("Location", f"{self.app.prefix}api/gpusched/leases/{result.lease['id']}")
        self.reply(result.lease, result.status)


class LeaseHandler(APIHandler):
    async def get(self, lease_id: str) -> None:
        self.reply(await self.run(lambda: self.broker.arbiter.lease(self.who, lease_id)))

    async def delete(self, lease_id: str) -> None:
        await self.run(lambda: self.broker.release(self.who, lease_id))
        self.set_status(204)
        self.finish()


class KeepHandler(APIHandler):
    async def post(self, lease_id: str) -> None:
        with bad_input():
            seconds = api_input.keep_seconds(self.body())
        self.reply(await self.run(lambda: self.broker.keep(self.who, lease_id, seconds)))


class DrainHandler(APIHandler):
    async def post(self, uuid: str, action: str) -> None:
        with bad_input():
            reason = api_input.reason(self.body())
        drained = action == "drain"
        self.reply(await self.run(lambda: self.broker.drain(self.who, uuid, drained, reason)))


class KernelEndedHandler(APIHandler):
    """``POST api/gpusched/kernels/{id}/ended``: a server says one of its kernels ended."""

    async def post(self, kernel_id: str) -> None:
        with bad_input():
            reason = api_input.reason(self.body()) or "the kernel was shut down"
        if self.who.kernel_id is not None:
            raise web.HTTPError(403, "a kernel's token cannot end kernels")
        await self.run(lambda: self.broker.kernel_ended(self.who, kernel_id, reason))
        self.set_status(204)
        self.finish()


class OpenAPIHandler(APIHandler):
    async def get(self) -> None:
        from ..server.openapi import openapi_document

        self.reply(openapi_document())


class MetricsHandler(APIHandler):
    async def get(self) -> None:
        if not self.who.admin:
            raise web.HTTPError(403, "metrics are for hub admins")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest())


class NotFoundHandler(APIHandler):
    async def prepare(self) -> None:
        raise web.HTTPError(404, f"no such endpoint: {self.request.path}")


class _Socket(_Hub, websocket.WebSocketHandler):
    """A websocket that sends events shaped for its principal."""

    def initialize(self, app: GPUBroker) -> None:
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

    def initialize(self, app: GPUBroker) -> None:
        super().initialize(app)
        self.server_id = ""
        self._orders: dict[str, asyncio.Future] = {}

    def open(self) -> None:  # type: ignore[override]
        who = self.who
        server_id = who.server_id
        if who.kernel_id is not None or not server_id:
            self.close(4400, f"a server names itself in {SERVER_HEADER}")
            return
        try:
            pid = int(self.request.headers.get(PID_HEADER) or 0) or None
        except ValueError:
            pid = None
        if pid is None or pid <= 1:
            self.close(4400, f"a server names its own process id in {PID_HEADER}")
            return
        started: float | None
        if self.app.verify_server_processes:
            try:
                started = procs.check_server_process(pid, who.user, self.token)
            except procs.NotTheirs as exc:
                log.warning("refused a server connection of %s (server id %s): %s", who.user, server_id, exc)
                self.close(4403, f"refused: {exc}")
                return
        else:
            started = procs.started(pid)
            if started is None:
                self.close(4403, f"refused: process {pid} does not run here")
                return
        try:
            self.broker.kernels.connect(server_id, who.user, pid, self, pid_started=started)
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


# -- the application --------------------------------------------------------------------------
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
        across restarts for leases to survive them. Default: gpusched-broker@<hostname>.""",
    ).tag(config=True)

    @default("broker_id")
    def _broker_id_default(self) -> str:
        return f"gpusched-broker@{socket.gethostname()}"

    @default("log_format")
    def _log_format_default(self) -> str:
        return "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"

    @default("log_datefmt")
    def _log_datefmt_default(self) -> str:
        return "%Y-%m-%d %H:%M:%S"

    @default("log_level")
    def _log_level_default(self) -> int:
        return logging.INFO

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
        if parsed.scheme not in ("http", "") or not parsed.port:
            raise TraitError(f"url must be http://HOST:PORT, not {self.url!r}")
        return parsed.hostname or "127.0.0.1", parsed.port

    async def setup(self) -> None:
        """Open the inventory and the ledger, start the arbiter and listen."""
        from jupyterhub.services.auth import HubOAuth

        from ..ledger import Ledger
        from ..metrics import Metrics
        from ..reclaim.checkpoint import detect
        from . import page

        ledger_path = self.resolved_ledger_path()
        os.makedirs(os.path.dirname(ledger_path) or ".", exist_ok=True)
        state_path = self.simulated_state_path or os.path.join(os.path.dirname(ledger_path), "gpusched-simulated.sqlite")
        backend, note = open_inventory(
            self.backend, self.simulated_devices, state_path, self.log, allow_shared=self.allow_shared_state_files
        )
        self.ledger = Ledger(ledger_path, allow_shared=self.allow_shared_state_files)
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
        self.arbiter = LocalArbiter(
            cfg=self.sched_config(),
            ledger=self.ledger,
            backend=backend,
            checkpointer=detect(backend, self.checkpoint),
            kernels=self.kernels,
            poll_interval=self.poll_interval,
            backend_note=note,
            mode="hub",
            show_holders=self.show_holders,
            metrics=Metrics(),
        )
        self.kernels.gpu_pids = lambda: {p.pid for d in self.arbiter.state.snapshot for p in d.processes}
        self.kernels.gpu_use = lambda: _gpu_use(self.arbiter.state.snapshot)
        self.broker = Broker(self.arbiter, self.kernels, heartbeat_interval=self.heartbeat_interval)
        self.hub_auth = HubOAuth(parent=self, cache_max_age=60)
        if not self.hub_auth.api_token:
            self.log.warning("JUPYTERHUB_API_TOKEN is not set: run the broker as a JupyterHub service")

        p = self.prefix
        api = p + "api/gpusched"
        kw = {"app": self}
        handlers: list[Any] = [
            (api + "/status", StatusHandler, kw),
            (api + "/devices", DevicesHandler, kw),
            (api + rf"/devices/{_UUID}/(?P<action>drain|undrain)", DrainHandler, kw),
            (api + "/leases", LeasesHandler, kw),
            (api + rf"/leases/{_ID}", LeaseHandler, kw),
            (api + rf"/leases/{_ID}/keep", KeepHandler, kw),
            (api + rf"/kernels/{_KERNEL}/ended", KernelEndedHandler, kw),
            (api + "/events", EventsSocket, kw),
            (api + "/servers/connect", ServerSocket, kw),
            (api + "/openapi.json", OpenAPIHandler, kw),
            (p + "metrics", MetricsHandler, kw),
            (p + "oauth_callback", page.OAuthCallbackHandler, kw),
            (p.rstrip("/") + "/?", page.PageHandler, kw),
            (p + rf"admin/devices/{_UUID}/(?P<action>drain|undrain)", page.DrainFormHandler, kw),
            (p + rf"admin/leases/{_ID}/release", page.ReleaseFormHandler, kw),
            (r".*", NotFoundHandler, kw),
        ]
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
        address, port = self.listen_address()
        self.http_server = HTTPServer(self.web_app, xheaders=True)
        self.http_server.listen(port, address)
        self._upkeep = asyncio.create_task(self._upkeep_loop())
        self.log.info(
            "GPU broker %s on %s%s: %s backend, %d GPU(s), ledger %s, policy %s",
            __version__, self.url.rstrip("/"), p, self.arbiter.backend_name,
            len(self.arbiter.state.snapshot), ledger_path, self.policy,
        )

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
        upkeep = getattr(self, "_upkeep", None)
        if upkeep is not None:
            upkeep.cancel()
        server = getattr(self, "http_server", None)
        if server is not None:
            server.stop()
        broker = getattr(self, "broker", None)
        for sock in list(broker.sockets if broker else ()):
            sock.close(1001, "the GPU broker is restarting")
        arbiter = getattr(self, "arbiter", None)
        if arbiter is not None:
            await arbiter.stop()
            if arbiter.backend is not None:
                arbiter.backend.close()
            arbiter.ledger.close()
        if server is not None:
            try:
                await asyncio.wait_for(server.close_all_connections(), 5)
            except asyncio.TimeoutError:
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
