"""The broker's service: the hub's rules around the arbiter, and its events for each websocket.

Whose kernel is whose and who may touch which lease are checked here before the arbiter is
asked; events go out to the connected websockets in batches, each shaped for its viewer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Iterable

from ..api.events import latest, shape
from ..api.views import Principal, iso
from ..arbiter import ArbiterEvent, HubPolicy, LocalArbiter
from ..core.forecast import gpu_states
from .remote import ENDED_MEMORY, RemoteKernels

log = logging.getLogger("jupyter_gpusched.broker")

#: Events are sent in batches at most this often (seconds); a batch has each lease's latest state.
EVENT_BATCH = 0.2


class Broker:
    """The broker's service: its servers' kernels ending, and events for every websocket.

    Who may do what is the arbiter's :class:`~jupyter_gpusched.arbiter.policy.HubPolicy`; the
    REST API calls the arbiter itself.
    """

    def __init__(self, arbiter: LocalArbiter, kernels: RemoteKernels, *, heartbeat_interval: float) -> None:
        self.arbiter = arbiter
        self.kernels = kernels
        self.heartbeat_interval = heartbeat_interval
        self.sockets: set[Any] = set()
        self.loop = asyncio.get_running_loop()
        self._pending: list[ArbiterEvent] = []
        self._flush_soon = False
        arbiter.subscribe(self._on_event)
        # Whose each kernel is, before the first heartbeat: after a restart, the first server to
        # report a kernel id must not take another user's kernel (and end its lease by dropping it).
        kernels.lease_user = self._lease_user
        kernels.remember_users(arbiter.ledger.kernel_users(released_since=arbiter.clock() - ENDED_MEMORY))

    def _lease_user(self, kernel_id: str) -> str | None:
        """The user of ``kernel_id``'s live lease, if it has one."""
        return next((le.user for le in self.arbiter.state.leases if le.kernel_id == kernel_id and le.live), None)

    # What the admin page asks (page.py); the arbiter's policy decides who may.
    async def status(self, who: Principal) -> dict:
        return await self.arbiter.status(who)

    async def drain(self, who: Principal, uuid: str, drained: bool, reason: str = "") -> dict:
        return await self.arbiter.drain(who, uuid, drained, reason)

    async def release(self, who: Principal, lease_id: str) -> dict | None:
        return await self.arbiter.release(who, lease_id)

    def node_summary(self, node: str) -> dict:
        """This node's GPUs, leases and queue in brief (``GET api/gpusched/node``)."""
        return node_summary(self.arbiter, node, self.kernels.connected_servers())

    async def kernel_ended(self, who: Principal, kernel_id: str, reason: str) -> None:
        """A server says one of its kernels ended: its leases are released now."""
        leases = [le for le in self.arbiter.state.leases if le.kernel_id == kernel_id and le.live]
        self.arbiter.policy.end_kernel(who, kernel_id, leases)
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


class BrokerPolicy(HubPolicy):
    """The hub's rules, and the name of the node this broker schedules in every status."""

    def __init__(self, kernels: Any, node: str) -> None:
        super().__init__(kernels)
        self.node = node

    def status_extras(self, who: Principal, status: dict) -> dict:
        status = super().status_extras(who, status)
        status["node"] = self.node
        return status


def node_summary(arbiter: LocalArbiter, node: str, servers: Iterable[frozenset[str]] = ()) -> dict:
    """The node's GPUs, leases and queue in brief, as the hub's spawn hook and the cluster view
    read them (``GET api/gpusched/node``; fields in the OpenAPI document).

    A GPU is *free* when it can be scheduled and no lease holds it, *reclaimable* when every
    lease on it can be taken back for another user's claim: an idle lease the reclaim ladder
    takes when someone else waits (borrowed capacity, or the dynamic policy) or takes anyway,
    or a lease already being reclaimed. The same rules as the scheduler's, read through the idle
    forecast of :mod:`jupyter_gpusched.core.forecast`.

    ``servers``: the kernel ids of each single-user server connected to this broker. A server
    none of whose kernels holds or waits for a lease (kernels bind at their first cell) will
    most likely claim soon: the spawn hook counts it against the node's room.
    """
    ctx = arbiter.view_context()
    live = [lease for lease in ctx.leases if lease.live]
    states, holders = gpu_states(ctx.devices, live, ctx.now, ctx.cfg, ctx.caps)
    devices = []
    for device in sorted(ctx.devices, key=lambda d: d.index):
        held = holders.get(device.uuid, [])
        state = states[device.uuid]
        devices.append(
            {
                "index": device.index,
                "uuid": device.uuid,
                "name": device.name,
                "memory_total": device.memory_total,
                "health": str(device.health),
                "state": state,
                "users": sorted({lease.user for lease in held}),
            }
        )
    by_id = {lease.id: lease for lease in live}
    leased = {lease.kernel_id for lease in live}
    waiting = [by_id[lid] for lid in arbiter.state.queue if lid in by_id and by_id[lid].waiting]
    return {
        "node": node,
        "time": iso(ctx.now),
        "policy": arbiter.cfg.policy,
        "backend": arbiter.backend_name,
        "gpus": sum(1 for state in states.values() if state != "unavailable"),
        "free": sum(1 for state in states.values() if state == "free"),
        "reclaimable": sum(1 for state in states.values() if state == "reclaimable"),
        "pending": len(waiting),
        "pending_gpus": sum(lease.count for lease in waiting),
        "leases": sum(1 for lease in live if lease.holding),
        "servers": len(servers),
        "servers_without_lease": sum(1 for kernels in servers if kernels.isdisjoint(leased)),
        "devices": devices,
        "queue": [
            {"position": n, "user": lease.user, "count": lease.count, "waiting_since": iso(lease.queued_at)}
            for n, lease in enumerate(waiting, start=1)
        ],
    }
