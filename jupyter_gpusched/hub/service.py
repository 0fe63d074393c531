"""The broker's service: the hub's rules around the arbiter, and its events for each websocket.

Whose kernel is whose and who may touch which lease are checked here before the arbiter is
asked; events go out to the connected websockets in batches, each shaped for its viewer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import psutil

from ..api.events import latest, shape
from ..api.routes import SERVER_HEADER
from ..api.views import Principal
from ..arbiter import ArbiterError, ArbiterEvent, BadRequest, ClaimResult, Forbidden, LocalArbiter, NotFound
from ..core import Lease
from .remote import RemoteKernels

log = logging.getLogger("jupyter_gpusched.broker")

#: Events are sent in batches at most this often (seconds); a batch has each lease's latest state.
EVENT_BATCH = 0.2


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

    async def devices(self, who: Principal) -> list[dict]:
        return await self.arbiter.devices(who)

    async def leases(self, who: Principal, kernel_id: str | None = None) -> list[dict]:
        return await self.arbiter.leases(who, kernel_id)

    async def lease(self, who: Principal, lease_id: str) -> dict:
        return await self.arbiter.lease(who, lease_id)

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

    async def cache_freed(self, who: Principal, lease_id: str, frameworks: tuple[str, ...]) -> dict:
        self._check_owner(who, lease_id)
        return await self.arbiter.cache_freed(who, lease_id, frameworks)

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
            await self.arbiter.replan()

    # events
    def shape(self, event: ArbiterEvent, who: Principal, ctx: Any = None) -> dict | None:
        """``event`` as ``who`` may see it (None: not for them; notices are personal)."""
        return shape(event, who, self.arbiter, ctx, own_notices_only=True)

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
        events, self._pending = latest(self._pending), []
        listeners = [sock for sock in list(self.sockets) if sock.listening]
        if not events or not listeners:
            return
        ctx = self.arbiter.view_context()
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
