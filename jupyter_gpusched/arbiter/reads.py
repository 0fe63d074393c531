"""What a :class:`~.local.LocalArbiter` answers without writing: status, devices, leases.

Reads come from the arbiter's last view of the world (``state``), never from the ledger, except
a lease that is no longer live (``_find``). Every view is shaped for the caller
(:mod:`jupyter_gpusched.api.views`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ..api.views import (
    Identities,
    Principal,
    ViewContext,
    device_json,
    for_viewer,
    iso,
    lease_json,
    queue_json,
    usage_json,
)
from ..core import Lease
from ..core.ladder import checkpoint_bytes
from ..core.fairness import explain
from ..devices.base import DeviceSnapshot
from .base import Forbidden


class LocalReads:
    """The read side of :class:`~.local.LocalArbiter` (a mixin: it uses the arbiter's state)."""

    # What the arbiter provides (see LocalArbiter.__init__).
    state: Any
    kernels: Any
    clock: Callable[[], float]
    cfg: Any
    caps: Any
    mode: str
    backend_note: str
    poll_interval: float
    show_holders: bool
    policy: Any
    backend_name: str
    _find: Callable[[str], Lease]
    trees: Any

    _context_of: tuple = ((), None)

    def view_context(self) -> ViewContext:
        """The context of every view, made again only when the arbiter's view of the world changed."""
        state = self.state
        key = (
            state.leases, state.queue, state.drained, state.snapshot, state.process_kernels, state.keys, state.usage,
            self.trees,
        )
        cached_key, ctx = self._context_of
        if ctx is None or len(cached_key) != len(key) or any(a is not b for a, b in zip(cached_key, key)):
            ctx = self._make_context()
            self._context_of = (key, ctx)
        return replace(ctx, now=self.clock())

    def _make_context(self) -> ViewContext:
        notebooks = {}
        if self.kernels is not None:
            for lease in self.state.leases:
                name = self.kernels.notebook(lease.kernel_id)
                if name:
                    notebooks[lease.kernel_id] = name
        positions = {lid: i for i, lid in enumerate(self.state.queue, start=1)}
        kernel_users = {lease.kernel_id: lease.user for lease in self.state.leases}
        if self.kernels is not None:
            for kernel_id in (set(self.state.process_kernels.values()) | set(self.trees)) - set(kernel_users):
                user = self.kernels.user_of(kernel_id)
                if user is not None:
                    kernel_users[kernel_id] = user
        by_id = {lease.id: lease for lease in self.state.leases}
        waiting = [by_id[lid] for lid in self.state.queue if lid in by_id]
        users = len({lease.user for lease in self.state.leases if lease.live})
        standing = explain(waiting, self.state.keys, self.state.recent, self.state.planned_at, self.cfg, users)
        # Everyone a text may name: whoever holds or waits, used a GPU lately or runs a kernel.
        identities = Identities.of(
            self.state.leases,
            kernel_users,
            self.state.process_kernels,
            users=(subject[5:] for subject in self.state.usage if subject.startswith("user:")),
            trees=self.trees,
        )
        return ViewContext(
            identities=identities,
            standing=standing,
            now=self.clock(),
            positions=positions,
            notebooks=notebooks,
            drained=self.state.drained,
            process_kernels=self.state.process_kernels,
            kernel_users=kernel_users,
            cfg=self.cfg,
            leases=self.state.leases,
            caps=self.caps,
            devices=self._core_devices(),
        )

    _devices_of: tuple = (None, None, ())

    def _core_devices(self) -> tuple:
        """The host's devices as the core sees them, made again only when the GPUs or drains change."""
        snapshot, drained, devices = self._devices_of
        if snapshot is not self.state.snapshot or drained is not self.state.drained:
            devices = tuple(d.to_core(drained=d.uuid in self.state.drained) for d in self.state.snapshot)
            self._devices_of = (self.state.snapshot, self.state.drained, devices)
        return devices

    def render_lease(self, lease: Lease, who: Principal, ctx: ViewContext | None = None) -> dict:
        index = {d.uuid: d.index for d in self.state.snapshot}
        return lease_json(lease, self._viewer(who), ctx or self.view_context(), index)

    def render_device(self, device: DeviceSnapshot, who: Principal, ctx: ViewContext | None = None) -> dict:
        return device_json(device, self.state.leases, self._viewer(who), ctx or self.view_context())

    def _viewer(self, who: Principal) -> Principal:
        if who.show_holders == self.show_holders:
            return who
        return replace(who, show_holders=self.show_holders)

    async def status(self, who: Principal) -> dict:
        ctx = self.view_context()
        by_id = {lease.id: lease for lease in self.state.leases}
        queue = [by_id[lid] for lid in self.state.queue if lid in by_id]
        viewer = self._viewer(who)
        status = {
            "mode": self.mode,
            "backend": self.backend_name,
            "backend_note": self.backend_note,
            "policy": self.cfg.policy,
            "user": who.user,
            "is_admin": who.admin,
            "checkpoint": {
                "available": self.caps.checkpoint,
                "reason": self.caps.checkpoint_reason,
                "host_memory_budget": self.cfg.checkpoint_host_memory,
                "host_memory_held": checkpoint_bytes(self.state.leases),
            },
            "devices": [self.render_device(d, viewer, ctx) for d in self.state.snapshot],
            "leases": [self.render_lease(le, viewer, ctx) for le in self.state.leases],
            "queue": queue_json(queue, viewer, ctx),
            "unleased_processes": list(self.state.unleased) if who.admin else [],
            "config": {
                "idle_timeout": self.cfg.idle_timeout,
                "contended_idle_timeout": self.cfg.contended_idle_timeout,
                "release_timeout": self.cfg.release_timeout,
                "grace_period": self.cfg.grace_period,
                "reclaim_fallback": self.cfg.reclaim_fallback,
                "max_keep": self.cfg.max_keep,
                "poll_interval": self.poll_interval,
                "usage_half_life": self.cfg.usage_half_life,
            },
            "time": iso(ctx.now),
        }
        status["usage"], status["group_usage"] = usage_json(
            self.state.usage, self.state.leases, ctx.devices, self.cfg, viewer, ctx.now
        )
        # Every field, those added here and by the policy too, as this viewer may see it (the
        # leases, devices and queue were shaped each as its owner's record already).
        return for_viewer(self.policy.status_extras(who, status), viewer, ctx)

    async def devices(self, who: Principal) -> list[dict]:
        ctx = self.view_context()
        return [self.render_device(d, who, ctx) for d in self.state.snapshot]

    async def leases(self, who: Principal, kernel_id: str | None = None) -> list[dict]:
        ctx = self.view_context()
        viewer = self._viewer(who)
        out = []
        for lease in self.state.leases:
            if kernel_id is not None and (lease.kernel_id != kernel_id or not viewer.sees(lease)):
                continue
            out.append(self.render_lease(lease, viewer, ctx))
        return out

    async def lease(self, who: Principal, lease_id: str) -> dict:
        lease = self._find(lease_id)
        if who.kernel_id is not None and lease.kernel_id != who.kernel_id:
            raise Forbidden("a kernel's token can only read that kernel's own lease")
        return self.render_lease(lease, who)

    async def lease_for_kernel(self, kernel_id: str) -> Lease | None:
        for lease in self.state.leases:
            if lease.kernel_id == kernel_id and lease.live:
                return lease
        return None

