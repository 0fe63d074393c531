"""``BrokerClient``: the :class:`~jupyter_gpusched.arbiter.base.Arbiter` of a single-user server in hub mode.

The server's REST API, magics, widgets, lab extension and provisioner talk to this object exactly
as they talk to a ``LocalArbiter``; it forwards each call to the hub's GPU broker, authenticated
with the server's own ``JUPYTERHUB_API_TOKEN`` (so the broker knows the user, their groups and
whether they are a hub admin), and a kernel's token narrows a call to that kernel's lease
(``X-GPUSched-Kernel``). The token goes only to a broker whose address nobody else can hold
(:mod:`jupyter_gpusched.transport`): its Unix socket, checked before each connection, or HTTPS
with a verified certificate. The server keeps one websocket open to the broker: it sends a heartbeat
every few seconds (its kernels, whether each executes, their process ids, as this server sees them
in its PID namespace, which it names when it connects), receives events shaped
for its user, and carries out the restarts and shutdowns the broker orders on its kernels. If the
broker goes away the server keeps trying to reconnect, with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import time
import urllib.parse
from typing import Any

from tornado import httputil, websocket
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from .. import procs, transport
from ..api.routes import HOST_HEADER, KERNEL_HEADER, PID_HEADER, PIDNS_HEADER, SERVER_HEADER
from ..api.input import Claim
from ..api.views import Principal, ViewContext, device_json, lease_json
from ..core import Lease, LeaseState
from ..devices.base import DeviceSnapshot
from .base import Arbiter, ArbiterError, ArbiterEvent, ClaimResult
from .base import BadRequest, Conflict, Forbidden, NoInventory, NotFound

#: How long ``start`` waits for the first connection before the server goes on without it.
CONNECT_WAIT = 5.0
#: The longest pause between two attempts to reach the broker.
MAX_BACKOFF = 15.0
#: The longest a claim waits for this server to reconnect to the broker before asking anyway, and
#: the least (a claim that does not wait in the queue still waits for a reconnection under way).
RECONNECT_WAIT = 30.0
MIN_RECONNECT_WAIT = 10.0
#: Seconds between looks for the broker's Unix socket while it is not there.
ABSENT_POLL = 0.5
#: Seconds an HTTP call may take beyond the claim's own wait.
REQUEST_TIMEOUT = 30.0

_ERRORS = {400: BadRequest, 403: Forbidden, 404: NotFound, 409: Conflict, 503: NoInventory}


class BrokerUnavailable(ArbiterError):
    status, reason = 503, "Service Unavailable"


def _unverified(address: transport.BrokerAddress, why: str) -> str:
    return (
        f"the hub's GPU broker at {address.where()} cannot be verified, so this server sends it nothing "
        f"(no token, no request): {why}. Ask the hub admin to look at the broker's address"
    )


def _error(status: int, message: str) -> ArbiterError:
    cls = _ERRORS.get(status)
    if cls is not None:
        return cls(message)
    err = ArbiterError(message, status)
    err.reason = httputil.responses.get(status, "Error")
    return err


def lease_from_json(data: dict) -> Lease:
    """A lease record from its JSON view (enough for the provisioner: state and devices)."""
    return Lease(
        id=data["id"],
        kernel_id=data.get("kernel_id") or "",
        user=data.get("user") or "",
        count=int(data.get("count") or 1),
        memory=data.get("memory"),
        mode=data.get("mode") or "exclusive",
        state=LeaseState(data.get("state") or "pending"),
        devices=tuple(data.get("devices") or ()),
        reason=data.get("reason") or "",
    )


class BrokerClient(Arbiter):
    """Schedules this server's kernels through the hub's GPU broker."""

    mode = "hub"

    def __init__(
        self,
        url: str,
        *,
        kernels: Any,
        user: str,
        log: logging.Logger | logging.LoggerAdapter | None = None,
        token: str | None = None,
        heartbeat_interval: float = 5.0,
        ca_file: str | None = None,
    ) -> None:
        super().__init__()
        self.address = transport.parse_broker_url(url)
        self.url = self.address.base
        self.ca_file = ca_file or None
        #: Why the broker's address cannot be trusted just now (None: it can, or it is not known yet).
        self.untrusted: str | None = None
        self.kernels = kernels
        self.server_id: str = kernels.server_id
        self.user = user
        self.log = log or logging.getLogger("jupyter_gpusched")
        self.token = token if token is not None else os.environ.get("JUPYTERHUB_API_TOKEN", "")
        self.heartbeat_interval = heartbeat_interval
        self.backend = None
        self.ledger = None
        self._http: AsyncHTTPClient | None = None
        self._ws: websocket.WebSocketClientConnection | None = None
        self._task: asyncio.Task | None = None
        self._connected: asyncio.Event | None = None
        self._beat: asyncio.Event | None = None
        self._orders: set[asyncio.Task] = set()
        self._listening: bool | None = None
        self._stopping = False

    def __repr__(self) -> str:
        return f"BrokerClient({self.address.url!r}, user={self.user!r})"

    # -- where the broker is, and whether it is the broker ---------------------------------------
    def _check_address(self) -> None:
        """Refuse to send anything to a Unix socket that another user could have made."""
        if self.address.socket_path is None:
            return
        try:
            transport.check_socket(self.address.socket_path)
        except transport.BrokerAbsent as exc:
            self.untrusted = None
            raise BrokerUnavailable(
                f"the hub's GPU broker is not running ({exc}); this server keeps trying. Try again in a moment, "
                "or ask the hub admin whether the gpusched service runs"
            ) from None
        except transport.UntrustedBroker as exc:
            why = str(exc)
            if why != self.untrusted:
                self.untrusted = why
                self.log.error("GPU scheduler: %s", _unverified(self.address, why))
            raise BrokerUnavailable(_unverified(self.address, why)) from None
        self.untrusted = None

    def _connect_options(self) -> dict[str, Any]:
        """What tornado's clients need to reach the broker: its socket, or TLS that checks its certificate."""
        if self.address.socket_path is not None:
            return {"resolver": transport.UnixResolver(path=self.address.socket_path)}
        return {}

    def _request_options(self) -> dict[str, Any]:
        if self.address.tls:
            return {"ssl_options": transport.client_ssl_context(self.ca_file)}
        return {}

    def _certificate_failure(self, exc: BaseException) -> str | None:
        """The reason a TLS connection failed on the broker's certificate, or None."""
        err: BaseException | None = exc
        while err is not None:
            if isinstance(err, ssl.SSLCertVerificationError):
                return f"its certificate was not accepted ({err.verify_message or err.reason})"
            if isinstance(err, ssl.SSLError):
                return f"the TLS handshake failed ({err.reason or err})"
            err = err.__cause__ or err.__context__
        return None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.address.loopback_http:
            self.log.warning(
                "GPU scheduler: the GPU broker's URL %s is plain HTTP on this host: while the broker is down any "
                "local user may listen there and collect this server's token. Use the broker's Unix socket "
                "(http+unix://...) or https:// with a CA file",
                self.address.url,
            )
        self._connected = asyncio.Event()
        self._beat = asyncio.Event()
        self._task = asyncio.create_task(self._connection_loop())
        try:
            await asyncio.wait_for(self._connected.wait(), CONNECT_WAIT)
        except asyncio.TimeoutError:
            self.log.warning(
                "GPU scheduler: the hub's GPU broker at %s does not answer yet; this server keeps trying",
                self.address.where(),
            )

    async def stop(self) -> None:
        self._stopping = True
        if self._ws is not None:
            self._ws.close(1001, "the server is stopping")
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
            self._task = None
        for task in list(self._orders):
            task.cancel()
        if self._ws is not None:
            self._ws.close()
            self._ws = None
        if self._http is not None:
            self._http.close()
            self._http = None

    @property
    def connected(self) -> bool:
        return self._ws is not None

    async def _until_connected(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) for this server's connection to the broker.

        The broker grants GPUs only to kernels of a connected server; a claim made while the
        server reconnects (the broker restarted) waits for the connection instead of being
        refused. The broker answers for itself when the connection does not come back.
        """
        if self._connected is None or self._connected.is_set() or timeout <= 0:
            return
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # -- the websocket ----------------------------------------------------------------------------
    def _headers(self, who: Principal | None = None) -> dict[str, str]:
        headers = {
            "Authorization": f"token {self.token}",
            SERVER_HEADER: self.server_id,
            # This process and its kernels as they know themselves (in a container, pids of its
            # own PID namespace); the broker maps them to the host's.
            PID_HEADER: str(os.getpid()),
            HOST_HEADER: socket.gethostname(),
        }
        pid_ns = procs.own_pid_namespace()
        if pid_ns:
            headers[PIDNS_HEADER] = str(pid_ns)
        if who is not None and who.kernel_id:
            headers[KERNEL_HEADER] = who.kernel_id
        return headers

    async def _connection_loop(self) -> None:
        ws_url = self.address.websocket_url("api/gpusched/servers/connect")
        backoff = 0.5
        failures = 0
        while not self._stopping:
            try:
                self._check_address()
                request = HTTPRequest(
                    ws_url, headers=self._headers(), connect_timeout=10, request_timeout=10, **self._request_options()
                )
                ws = await websocket.websocket_connect(
                    request, ping_interval=20, max_message_size=16 * 1024 * 1024, **self._connect_options()
                )
            except asyncio.CancelledError:
                raise
            except BrokerUnavailable as exc:
                failures += 1  # an untrusted address was logged once by _check_address
                if self.untrusted is None and failures in (1, 10):
                    self.log.warning("GPU scheduler: %s", exc.message)
                if self.untrusted is None:
                    # No socket yet: looking for it again costs nothing, so the server is back
                    # within moments of the broker.
                    await asyncio.sleep(ABSENT_POLL)
                    continue
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            except Exception as exc:  # noqa: BLE001 - any failure: wait and try again
                failures += 1
                level = logging.WARNING if failures in (1, 10) or failures % 100 == 0 else logging.DEBUG
                certificate = self._certificate_failure(exc)
                if certificate is not None:
                    if certificate != self.untrusted:
                        self.untrusted = certificate
                        self.log.error("GPU scheduler: %s", _unverified(self.address, certificate))
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF)
                    continue
                if isinstance(exc, HTTPClientError) and exc.code == 403:
                    level = logging.ERROR if failures == 1 else level
                    why = (
                        "the broker refused this server's token (403): the server's token needs the scope "
                        "access:services!service=<broker service name> (c.Spawner.server_token_scopes) "
                        "and the user must hold it too"
                    )
                else:
                    why = str(exc)
                self.log.log(level, "GPU scheduler: cannot reach the GPU broker at %s: %s", self.address.where(), why)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            if failures:
                self.log.info("GPU scheduler: connected to the GPU broker at %s", self.address.where())
            backoff, failures = 0.5, 0
            self.untrusted = None
            self._ws = ws
            beats = asyncio.create_task(self._heartbeats(ws))
            try:
                while True:
                    message = await ws.read_message()
                    if message is None:
                        break
                    self._on_message(message)
            finally:
                beats.cancel()
                ws.close()
                self._ws = None
                if self._connected is not None:
                    self._connected.clear()
            if not self._stopping:
                self.log.warning(
                    "GPU scheduler: lost the connection to the GPU broker (%s); reconnecting",
                    ws.close_reason or ws.close_code or "closed",
                )
                await asyncio.sleep(backoff)

    def _on_message(self, raw: str | bytes) -> None:
        try:
            data = json.loads(raw)
        except ValueError:
            self.log.warning("GPU scheduler: unreadable message from the broker")
            return
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "welcome":
            interval = data.get("heartbeat_interval")
            if isinstance(interval, (int, float)) and interval > 0:
                self.heartbeat_interval = float(interval)
            if self._connected is not None:
                self._connected.set()
            self._listening = None
            self._tell_listening()
        elif kind == "events" and isinstance(data.get("events"), list):
            for event in data["events"]:
                if isinstance(event, dict):
                    self.publish(ArbiterEvent(str(event.get("type")), payload=event))
        elif kind == "order":
            task = asyncio.create_task(self._carry_out(data))
            self._orders.add(task)
            task.add_done_callback(self._orders.discard)
        elif kind == "error":
            self.log.warning("GPU scheduler: the broker says: %s", data.get("message"))

    async def _carry_out(self, order: dict) -> None:
        """Restart or shut down one of this server's kernels, as the broker ordered."""
        action, kernel_id, order_id = order.get("action"), order.get("kernel_id"), order.get("id")
        ok, message = False, ""
        try:
            if action not in ("restart", "shutdown") or not isinstance(kernel_id, str):
                message = f"unknown order {action!r}"
            elif not self.kernels.alive(kernel_id):
                message = f"no kernel {kernel_id} on this server"
            else:
                self.log.info("GPU scheduler: the broker reclaims a GPU: %s kernel %s", action, kernel_id)
                if action == "restart":
                    await self.kernels.restart(kernel_id)
                else:
                    await self.kernels.shutdown(kernel_id)
                ok = True
        except Exception as exc:  # noqa: BLE001 - report any failure back to the broker
            self.log.exception("GPU scheduler: could not %s kernel %s", action, kernel_id)
            message = str(exc) or exc.__class__.__name__
        await self._send({"type": "done", "id": order_id, "ok": ok, "message": message})
        self.beat_now()

    # Events are shaped and sent by the broker only while someone here listens (a browser's
    # events websocket is open), so that idle servers cost it nothing.
    def subscribe(self, listener) -> None:
        super().subscribe(listener)
        self._tell_listening()

    def unsubscribe(self, listener) -> None:
        super().unsubscribe(listener)
        self._tell_listening()

    def _tell_listening(self) -> None:
        want = self.listening
        if self._ws is None or want == self._listening:
            return
        self._listening = want
        task = asyncio.ensure_future(self._send({"type": "listen", "on": want}))
        self._orders.add(task)
        task.add_done_callback(self._orders.discard)

    async def _send(self, payload: dict) -> None:
        ws = self._ws
        if ws is None:
            return
        try:
            await ws.write_message(json.dumps(payload))
        except websocket.WebSocketClosedError:
            pass

    def beat_now(self) -> None:
        """Send a heartbeat now (a kernel started, ended or got its process)."""
        if self._beat is not None:
            self._beat.set()

    async def _heartbeats(self, ws) -> None:
        while True:
            try:
                payload = await self.heartbeat()
                await ws.write_message(json.dumps(payload))
            except websocket.WebSocketClosedError:
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next beat may work
                self.log.exception("GPU scheduler: heartbeat failed")
            assert self._beat is not None
            self._beat.clear()
            try:
                await asyncio.wait_for(self._beat.wait(), self.heartbeat_interval)
            except asyncio.TimeoutError:
                pass

    async def heartbeat(self) -> dict:
        """This server's kernels: execution state, last activity, process id, notebook.

        The broker finds each kernel's child processes itself (it believes no list of them).
        """
        await self.kernels.refresh_notebooks()
        states = self.kernels.activity()
        kernels = {}
        for kernel_id, (busy, last_busy_at, started_at) in states.items():
            kernels[kernel_id] = {
                "busy": bool(busy),
                "last_busy_at": last_busy_at,
                "started_at": started_at,
                "pid": self.kernels.kernel_pid(kernel_id),
                "notebook": self.kernels.notebook(kernel_id),
                "restarting": bool(self.kernels.restarting(kernel_id)),
            }
        return {"type": "heartbeat", "kernels": kernels}

    # -- HTTP -------------------------------------------------------------------------------------
    async def call(
        self,
        method: str,
        path: str,
        who: Principal | None = None,
        body: dict | None = None,
        query: dict | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> tuple[int, Any]:
        """One REST call to the broker; raises the matching :class:`ArbiterError` on an error."""
        self._check_address()
        if self._http is None:
            self._http = AsyncHTTPClient(force_instance=True, max_clients=64, **self._connect_options())
        url = self.url + "api/gpusched/" + path
        if query:
            query = {k: v for k, v in query.items() if v is not None}
            if query:
                url += "?" + urllib.parse.urlencode(query)
        headers = self._headers(who)
        payload = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            payload = json.dumps(body)
        elif method in ("POST", "PUT"):
            payload = ""
        request = HTTPRequest(
            url,
            method=method,
            headers=headers,
            body=payload,
            connect_timeout=10,
            request_timeout=timeout,
            allow_nonstandard_methods=True,
            **self._request_options(),
        )
        try:
            response = await self._http.fetch(request, raise_error=False)
        except Exception as exc:  # noqa: BLE001 - a broker that is down is a 503 for the caller
            certificate = self._certificate_failure(exc)
            if certificate is not None:
                raise BrokerUnavailable(_unverified(self.address, certificate)) from None
            raise BrokerUnavailable(
                f"the hub's GPU broker is not reachable ({exc}); try again in a moment, or ask the "
                "hub admin whether the gpusched service runs"
            ) from None
        if response.code == 599:
            certificate = self._certificate_failure(response.error) if response.error else None
            if certificate is not None:
                raise BrokerUnavailable(_unverified(self.address, certificate))
            raise BrokerUnavailable(
                f"the hub's GPU broker is not reachable ({response.error}); try again in a moment, or ask "
                "the hub admin whether the gpusched service runs"
            )
        data = None
        if response.body:
            try:
                data = json.loads(response.body)
            except ValueError:
                data = None
        if response.code >= 400:
            message = data.get("message") if isinstance(data, dict) else None
            if response.code >= 500 and not message:
                message = "the hub's GPU broker failed; ask the hub admin to look at its log"
            raise _error(response.code, message or response.reason or "the broker refused the request")
        return response.code, data

    # -- Arbiter ----------------------------------------------------------------------------------
    async def status(self, who: Principal) -> dict:
        return (await self.call("GET", "status", who))[1]

    async def devices(self, who: Principal) -> list[dict]:
        return (await self.call("GET", "devices", who))[1]

    async def leases(self, who: Principal, kernel_id: str | None = None) -> list[dict]:
        return (await self.call("GET", "leases", who, query={"kernel_id": kernel_id}))[1]

    async def lease(self, who: Principal, lease_id: str) -> dict:
        return (await self.call("GET", f"leases/{urllib.parse.quote(lease_id, safe='')}", who))[1]

    async def claim(self, who: Principal, ask: Claim) -> ClaimResult:
        if who.kernel_id is not None and who.kernel_id != ask.kernel_id:
            raise Forbidden("a kernel's token can only ask for that kernel's own lease")
        if not self.kernels.alive(ask.kernel_id):
            raise NotFound(f"no running kernel {ask.kernel_id!r} on this server")
        if who.kernel_id is not None:
            self.kernels.asking(ask.kernel_id)
        await self._until_connected(max(min(ask.wait, RECONNECT_WAIT), MIN_RECONNECT_WAIT))
        body: dict[str, Any] = {"kernel_id": ask.kernel_id, "priority": ask.priority, "wait": ask.wait}
        for name, value in (("count", ask.count), ("memory", ask.memory), ("mode", ask.mode)):
            if value is not None:
                body[name] = value
        timeout = min(max(ask.wait, 0.0), 60.0) + REQUEST_TIMEOUT
        status, lease = await self.call("POST", "leases", who, body=body, timeout=timeout)
        self.beat_now()
        return ClaimResult(status, lease)

    async def release(self, who: Principal, lease_id: str, memory_held: str = "release") -> dict | None:
        query = {"memory_held": memory_held} if memory_held != "release" else None
        status, data = await self.call("DELETE", f"leases/{urllib.parse.quote(lease_id, safe='')}", who, query=query)
        return data if status == 200 and isinstance(data, dict) else None

    async def keep(self, who: Principal, lease_id: str, seconds: float) -> dict:
        path = f"leases/{urllib.parse.quote(lease_id, safe='')}/keep"
        return (await self.call("POST", path, who, body={"seconds": seconds}))[1]

    async def cache_freed(self, who: Principal, lease_id: str, frameworks: tuple[str, ...]) -> dict:
        path = f"leases/{urllib.parse.quote(lease_id, safe='')}/freed"
        return (await self.call("POST", path, who, body={"frameworks": list(frameworks)}))[1]

    async def drain(self, who: Principal, uuid: str, drained: bool, reason: str = "") -> dict:
        path = f"devices/{urllib.parse.quote(uuid, safe='')}/{'drain' if drained else 'undrain'}"
        return (await self.call("POST", path, who, body={"reason": reason}))[1]

    async def kernel_started(self, kernel_id: str, user: str, pid: int | None) -> None:
        self.beat_now()

    async def kernel_ended(self, kernel_id: str, reason: str) -> None:
        try:
            await self.call("POST", f"kernels/{urllib.parse.quote(kernel_id, safe='')}/ended", body={"reason": reason})
        except ArbiterError as exc:
            # The next heartbeat tells the broker anyway.
            self.log.warning("GPU scheduler: could not tell the broker that kernel %s ended: %s", kernel_id, exc.message)
        self.beat_now()

    async def lease_for_kernel(self, kernel_id: str) -> Lease | None:
        try:
            leases = await self.leases(Principal(user=self.user), kernel_id)
        except ArbiterError as exc:
            self.log.warning("GPU scheduler: could not ask the broker for kernel %s's lease: %s", kernel_id, exc.message)
            return None
        for data in leases:
            if data.get("state") != "released" and data.get("kernel_id") == kernel_id:
                return lease_from_json(data)
        return None

    # The broker plans and shapes events for this server's user: what is left here is little.
    async def replan(self) -> None:
        """The broker plans on its own ticks; a heartbeat now tells it what changed here."""
        self.beat_now()

    def view_context(self) -> ViewContext:
        return ViewContext(now=time.time())

    def render_lease(self, lease: Lease, who: Principal, ctx: ViewContext | None = None) -> dict:
        """A lease as this server knows it (events from the broker come already shaped)."""
        return lease_json(lease, who, ctx or self.view_context(), {})

    def render_device(self, device: DeviceSnapshot, who: Principal, ctx: ViewContext | None = None) -> dict:
        return device_json(device, (), who, ctx or self.view_context())
