"""JSON views of devices and leases (the OpenAPI document, api/openapi.py), shaped for the person who asks.

Times are ISO 8601 UTC, sizes bytes. In hub mode a user sees other users' leases as held by
"another user" (no kernel ids, no notebook) unless the admin allows names (``show_holders``).
Free text is shaped the same way: :func:`for_viewer` is the one place that hides other users'
names, kernel ids and process ids in a view, and every view and event goes through it.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

from ..core import Capabilities, Device, Lease, LeaseState, SchedConfig
from ..core import fairness
from ..core import usage as core_usage
from ..core.forecast import forecast
from ..devices.base import DeviceSnapshot

ANOTHER_USER = "another user"
#: What another user's kernel, and a process of theirs, are called where their names are hidden.
ANOTHER_KERNEL = "another user's kernel"
ANOTHER_PROCESS = "another user's process"


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
    #: Whose each user name, kernel id and process id is (None: made from the fields above).
    identities: Identities | None = None

    def who_is_who(self) -> Identities:
        """:attr:`identities`, made from the leases, kernels and processes when not given."""
        if self.identities is None:
            self.identities = Identities.of(self.leases, self.kernel_users, self.process_kernels)
        return self.identities


@dataclass(frozen=True)
class Identities:
    """Whose each user name, kernel id and GPU process id of the host is: what a view hides.

    ``kernels`` and ``pids`` map to the user they belong to (None: nobody knows whose).
    """

    users: frozenset[str] = frozenset()
    kernels: Mapping[str, str | None] = field(default_factory=dict)
    pids: Mapping[int, str | None] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        leases: Iterable[Lease] = (),
        kernel_users: Mapping[str, str] | None = None,
        process_kernels: Mapping[int, str] | None = None,
        users: Iterable[str] = (),
        trees: Mapping[str, Iterable[int]] | None = None,
    ) -> Identities:
        """Everyone the host knows of: the leases' users and kernels, the users of kernels
        (``kernel_users``), the kernel of each GPU process (``process_kernels``) and each kernel's
        processes (``trees``), and more users (those with recent usage, say)."""
        kernels: dict[str, str | None] = {}
        names = {name for name in users if name}
        for lease in leases:
            kernels[lease.kernel_id] = lease.user
            names.add(lease.user)
        for kernel_id, user in (kernel_users or {}).items():
            kernels.setdefault(kernel_id, user)
            if user:
                names.add(user)
        pids: dict[int, str | None] = {}
        for kernel_id, tree in (trees or {}).items():
            for pid in tree:
                pids[pid] = kernels.get(kernel_id)
        for pid, kernel_id in (process_kernels or {}).items():
            pids[pid] = kernels.get(kernel_id)
        kernels.pop("", None)
        return cls(frozenset(names), kernels, pids)

    @cached_property
    def pattern(self) -> re.Pattern[str]:
        """Every name and kernel id as a word, every ``pid N`` and ``process N`` (one pass).

        The neutral words come first, so that text shaped once is left as it is: a user named
        "user" or "another" never turns "another user" into something else.
        """
        neutral = "|".join(re.escape(w) for w in (ANOTHER_KERNEL, ANOTHER_PROCESS, ANOTHER_USER))
        parts = [rf"(?P<neutral>{neutral})"]
        names = sorted((n for n in self.users if n.strip()), key=len, reverse=True)
        if names:
            alternatives = "|".join(re.escape(n) for n in names)
            # A name as a word: "alice's", "alice." and "(alice)" name her, "alice.b" and
            # "alice-2" do not; "user alice" is said as one.
            parts.append(rf"(?:\buser\s+)?(?<![\w@.+-])(?P<name>{alternatives})(?![\w@+-]|\.\w)")
        kernels = sorted((k for k in self.kernels if k), key=len, reverse=True)
        if kernels:
            alternatives = "|".join(re.escape(k) for k in kernels)
            parts.append(rf"(?:\bkernel\s+)?(?<![\w-])(?P<kernel>{alternatives})(?![\w-])")
        parts.append(r"\b(?i:pid|process)\s+(?P<pid>\d+)\b")
        return re.compile("|".join(parts))


#: Fields whose strings are ids or fixed words, never free text: never shaped (a user named
#: "idle" must not turn a lease's state into "another user").
_FIXED = frozenset(
    {
        "id", "lease_id", "lease_ids", "uuid", "parent_uuid", "devices", "state", "mode", "health", "step",
        "reclaim_step", "kind", "type", "contended_by", "policy", "backend", "mig_profile", "name",
    }
)


def sees_everyone(viewer: Principal) -> bool:
    """Whether ``viewer`` sees every user's names, kernels and processes (a hub admin, or
    ``show_holders``; a single user's server is its user's, who is its admin)."""
    return viewer.admin or viewer.show_holders


def for_viewer(value: Any, viewer: Principal, ctx: ViewContext | Identities | None, owner: str | None = None) -> Any:
    """``value`` (text, or a JSON value walked through) as ``viewer`` may see it.

    Where ``viewer`` may not see other users (:func:`sees_everyone`), other users' names become
    "another user", their kernel ids "another user's kernel" and the ids of their processes
    "another user's process". ``owner``: the user whose record ``value`` is (a lease's, a
    notice's; None: the host's). In a record of another user, every name, kernel id and process
    id is hidden, the viewer's own too, so that the record reads the same to everyone it is
    hidden from; in the viewer's own record and in the host's, only other users'. Strings of
    ids and fixed words (``_FIXED``) are left as they are.
    """
    if sees_everyone(viewer):
        return value
    if isinstance(ctx, ViewContext):
        known = ctx.who_is_who()
    else:
        known = ctx or Identities()
    everyone = owner is not None and owner != viewer.user
    return _shape(value, viewer.user, known, everyone)


def _shape(value: Any, user: str, known: Identities, everyone: bool) -> Any:
    if isinstance(value, str):
        return _hide(value, user, known, everyone)
    if isinstance(value, dict):
        return {key: item if _fixed(key, item) else _shape(item, user, known, everyone) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shape(item, user, known, everyone) for item in value]
    return value


def _fixed(key: str, item: Any) -> bool:
    """Whether ``item`` is an id or a fixed word (or a list of them), never free text."""
    if key not in _FIXED:
        return False
    return isinstance(item, str) or (isinstance(item, list) and all(isinstance(x, str) for x in item))


def _hide(text: str, user: str, known: Identities, everyone: bool) -> str:
    if not text:
        return text

    def replace(match: re.Match[str]) -> str:
        if match.group("neutral") is not None:
            return match.group(0)
        name = match.groupdict().get("name")
        if name is not None:
            return ANOTHER_USER if everyone or name != user else match.group(0)
        kernel_id = match.groupdict().get("kernel")
        if kernel_id is not None:
            return ANOTHER_KERNEL if everyone or known.kernels.get(kernel_id) != user else match.group(0)
        owner = known.pids.get(int(match.group("pid")), None)
        # A process nobody knows is hidden in another user's record, kept in one's own.
        hidden = everyone or (owner is not None and owner != user)
        return ANOTHER_PROCESS if hidden else match.group(0)

    return known.pattern.sub(replace, text)


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
    out = {
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
    return for_viewer(out, viewer, ctx, owner=lease.user)


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
    lease_of = {lease.kernel_id: lease.id for lease in held_by}
    for proc in snap.processes:
        kernel_id = ctx.process_kernels.get(proc.pid)
        user = ctx.kernel_users.get(kernel_id) if kernel_id else None
        if not (sees_everyone(viewer) or (user is not None and user == viewer.user)):
            # Another user's process (or one nobody knows whose): not even its pid is shown.
            continue
        processes.append(
            {
                "pid": proc.pid,
                "memory_used": proc.memory_used,
                "kernel_id": kernel_id,
                # Null: outside every lease (no kernel's, or a kernel's whose lease is not on
                # this GPU, such as one released with its memory kept): its memory counts as taken.
                "lease_id": lease_of.get(kernel_id) if kernel_id else None,
                "user": user,
            }
        )
    out = {
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
    return for_viewer(out, viewer, ctx)


def queue_json(queue: Sequence[Lease], viewer: Principal, ctx: ViewContext | None = None) -> list[dict]:
    out = []
    known = ctx if ctx is not None else Identities.of(queue)
    for position, lease in enumerate(queue, start=1):
        visible = viewer.sees(lease)
        entry = {
                "lease_id": lease.id,
                "kernel_id": lease.kernel_id if visible else None,
                "user": lease.user if visible else ANOTHER_USER,
                "position": position,
                "count": lease.count,
                "waiting_since": iso(lease.queued_at),
                "reason": (waiting_reason(lease, ctx) if ctx is not None else lease.reason) if visible else "",
            }
        out.append(for_viewer(entry, viewer, known, owner=lease.user))
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
