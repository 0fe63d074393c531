"""JSON views of devices and leases (DESIGN section 8), shaped for the person who asks.

Times are ISO 8601 UTC, sizes bytes. In hub mode a user sees other users' leases as held by
"another user" (no kernel ids, no notebook) unless the admin allows names (``show_holders``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from ..core import Capabilities, Device, Lease, LeaseState, SchedConfig
from ..core import fairness
from ..core import usage as core_usage
from ..core.forecast import forecast
from ..devices.base import DeviceSnapshot

ANOTHER_USER = "another user"


@dataclass(frozen=True)
class Principal:
    """Who is asking: a user (with groups and admin rights), or one kernel through its token."""

    user: str
    groups: tuple[str, ...] = ()
    admin: bool = False
    kernel_id: str | None = None
    server_id: str = ""
    show_holders: bool = True

    def owns(self, lease: Lease) -> bool:
        """Whether this caller may act on ``lease`` (release, keep)."""
        if self.kernel_id is not None:
            return lease.kernel_id == self.kernel_id
        return self.admin or lease.user == self.user

    def sees(self, lease: Lease) -> bool:
        """Whether this caller sees who holds ``lease`` and its kernel."""
        return self.show_holders or self.admin or lease.user == self.user


@dataclass
class ViewContext:
    """What a view needs beyond the records: the clock, queue positions, notebook names."""

    now: float
    positions: Mapping[str, int] = field(default_factory=dict)
    notebooks: Mapping[str, str] = field(default_factory=dict)
    drained: Mapping[str, str] = field(default_factory=dict)
    process_kernels: Mapping[int, str] = field(default_factory=dict)
    #: The user of each kernel that uses a GPU, where known (never shown unless the viewer may).
    kernel_users: Mapping[str, str] = field(default_factory=dict)
    #: The scheduling settings and every live lease, for views that look ahead (None: not known).
    cfg: SchedConfig | None = None
    leases: Sequence[Lease] = ()
    #: What the driver can do (checkpoints) and the host's schedulable devices, for the same views.
    caps: Capabilities | None = None
    devices: Sequence[Device] = ()
    #: Why each waiting claim stands where it does in the fair queue (``fairness.explain``).
    standing: Mapping[str, str] = field(default_factory=dict)


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    stamp = dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def lease_json(
    lease: Lease,
    viewer: Principal,
    ctx: ViewContext,
    index_of: Mapping[str, int],
) -> dict:
    """A lease as the REST API and the events websocket show it to ``viewer``."""
    visible = viewer.sees(lease)
    idle = lease.idle_seconds(ctx.now) if lease.holding else None
    # What idle reclaim will do (null: no GPU held, or the settings are unknown). The driver's
    # capabilities and the host's devices decide the step and the fair share; a context without
    # them forecasts as for a host without checkpoint support.
    idle_forecast = None
    if ctx.cfg is not None and lease.holding:
        caps = ctx.caps or Capabilities()
        found = forecast(lease, ctx.leases or (lease,), ctx.now, ctx.cfg, caps, ctx.devices)
        if found is not None:
            idle_forecast = {
                "step": found.step.value if found.step is not None else None,
                "at": iso(found.at),
                "contended_at": iso(found.contended_at),
                "contended_by": found.contended_by,
                "reason": found.reason,
            }
    return {
        "id": lease.id,
        "kernel_id": lease.kernel_id if visible else None,
        "user": lease.user if visible else ANOTHER_USER,
        "holder": lease.user if visible else ANOTHER_USER,
        "notebook": ctx.notebooks.get(lease.kernel_id) if visible else None,
        "count": lease.count,
        "devices": list(lease.devices),
        "device_indices": [index_of[u] for u in lease.devices if u in index_of],
        "memory": lease.memory,
        "mode": lease.mode,
        "priority": lease.priority,
        "state": lease.state.value,
        "position": ctx.positions.get(lease.id) if lease.state == LeaseState.PENDING else None,
        "created_at": iso(lease.created_at),
        "granted_at": iso(lease.granted_at),
        "last_active_at": iso(lease.last_active_at),
        "idle_seconds": round(idle, 1) if idle is not None else None,
        "reclaim_at": iso(lease.reclaim_at),
        "reclaim_step": lease.reclaim_step.value if lease.reclaim_step else None,
        "keep_until": iso(lease.keep_until),
        "memory_held": lease.memory_held,
        "over_share_since": iso(lease.over_share_since),
        "reason": waiting_reason(lease, ctx) if visible else "",
        "mine": viewer.owns(lease) and not (viewer.admin and lease.user != viewer.user),
        "idle_forecast": idle_forecast,
    }


def waiting_reason(lease: Lease, ctx: ViewContext) -> str:
    """The lease's reason; for a waiting claim, followed by why it stands where it does in the queue."""
    standing = ctx.standing.get(lease.id) if lease.state == LeaseState.PENDING else None
    if not standing:
        return lease.reason
    return f"{lease.reason}; {standing}" if lease.reason else standing


def device_json(
    snap: DeviceSnapshot,
    leases: Iterable[Lease],
    viewer: Principal,
    ctx: ViewContext,
) -> dict:
    """A device with telemetry, the leases on it and the processes using it."""
    held_by = [lease for lease in leases if lease.holding and snap.uuid in lease.devices]
    health = snap.health
    if health == "ok" and snap.uuid in ctx.drained:
        health = "drained"
    processes = []
    for proc in snap.processes:
        kernel_id = ctx.process_kernels.get(proc.pid)
        shown = kernel_id if kernel_id and _sees_kernel(viewer, ctx.kernel_users.get(kernel_id)) else None
        processes.append({"pid": proc.pid, "memory_used": proc.memory_used, "kernel_id": shown})
    return {
        "uuid": snap.uuid,
        "index": snap.index,
        "name": snap.name,
        "memory_total": snap.memory_total,
        "memory_used": snap.memory_used,
        "utilization": snap.utilization,
        "health": health,
        "drain_reason": ctx.drained.get(snap.uuid),
        "parent_uuid": snap.parent_uuid,
        "mig_profile": snap.mig_profile,
        "lease_ids": [lease.id for lease in held_by],
        "processes": processes,
    }


def _sees_kernel(viewer: Principal, user: str | None) -> bool:
    """Whether ``viewer`` may see the id of a kernel of ``user`` (None: a user nobody knows)."""
    return viewer.show_holders or viewer.admin or (user is not None and user == viewer.user)


def queue_json(queue: Sequence[Lease], viewer: Principal, ctx: ViewContext | None = None) -> list[dict]:
    out = []
    for position, lease in enumerate(queue, start=1):
        visible = viewer.sees(lease)
        out.append(
            {
                "lease_id": lease.id,
                "kernel_id": lease.kernel_id if visible else None,
                "user": lease.user if visible else ANOTHER_USER,
                "position": position,
                "count": lease.count,
                "waiting_since": iso(lease.queued_at),
                "reason": (waiting_reason(lease, ctx) if ctx is not None else lease.reason) if visible else "",
            }
        )
    return out


def usage_json(
    records: Mapping[str, core_usage.Accrued],
    leases: Sequence[Lease],
    devices: Sequence[Device],
    cfg: SchedConfig,
    viewer: Principal,
    now: float,
) -> tuple[list[dict], list[dict]]:
    """Recent usage per user and per group, most used first: ``(users, groups)``.

    A user entry is ``{user, gpu_hours, quota, held}``: GPU-hours held recently (decayed with
    ``usage_half_life``), GPUs guaranteed, GPUs' worth held now (a shared lease counts its share
    of the GPU's memory). A group entry is ``{group, gpu_hours, held}``. Every user with recent
    usage or a live lease is listed; another user's name is shown as for their leases, and a
    group only to its members unless holders are shown. Both empty when usage is not tracked.
    """
    if cfg.usage_half_life <= 0:
        return [], []
    recent = core_usage.recent(records, now, cfg.usage_half_life)
    held = core_usage.held_by_subject(leases, devices)
    groups_of: dict[str, tuple[str, ...]] = {}
    for lease in leases:
        if lease.live:
            groups_of.setdefault(lease.user, lease.groups)
    share = fairness.fair_share(devices, leases)
    names = {s[5:] for s in recent if s.startswith("user:")} | set(groups_of)
    everyone = viewer.show_holders or viewer.admin
    users = []
    for name in names:
        users.append(
            {
                "user": name if everyone or name == viewer.user else ANOTHER_USER,
                "gpu_hours": round(recent.get(f"user:{name}", 0.0) / 3600.0, 3),
                "quota": fairness.quota_of(name, groups_of.get(name, ()), cfg.quotas, share),
                "held": round(held.get(f"user:{name}", 0.0), 3),
            }
        )
    users.sort(key=lambda u: (-u["gpu_hours"], -u["held"], u["user"]))
    groups = []
    for subject in sorted({s for s in recent if s.startswith("group:")} | {s for s in held if s.startswith("group:")}):
        name = subject[6:]
        if not (everyone or name in viewer.groups):
            continue
        groups.append(
            {
                "group": name,
                "gpu_hours": round(recent.get(subject, 0.0) / 3600.0, 3),
                "held": round(held.get(subject, 0.0), 3),
            }
        )
    groups.sort(key=lambda g: (-g["gpu_hours"], -g["held"], g["group"]))
    return users, groups
