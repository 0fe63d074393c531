"""The scheduling model: devices, leases, kernel activity and configuration.

Everything here is a frozen dataclass. The core never mutates a record: it returns new ones with
``dataclasses.replace`` and a decision that says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Mapping

# The names of states and steps are shared with the kernel side, which loads no core code.
from ..names import LeaseState, Name, Step

GiB = 1024**3

EXCLUSIVE = "exclusive"
SHARED = "shared"
MODES = (EXCLUSIVE, SHARED)

POLICIES = ("static", "dynamic", "hybrid")
FALLBACKS = ("restart", "shutdown", "none")

#: States in which a lease holds devices.
HOLDING = frozenset({LeaseState.ACTIVE, LeaseState.IDLE, LeaseState.RECLAIMING})
#: States in which a lease is still alive (not released).
LIVE = frozenset(HOLDING | {LeaseState.PENDING, LeaseState.SUSPENDED})


class Health(Name):
    OK = "ok"
    LOST = "lost"
    DRAINED = "drained"


class SchedulingError(ValueError):
    """A request the core cannot accept; the message is meant for a person."""


class NoCapacity(SchedulingError):
    """Nothing on this host can ever hold the claim now: it has no GPUs, or all are drained or lost."""


class ConflictError(SchedulingError):
    """A request that clashes with the current state (a second lease for one kernel, say)."""


@dataclass(frozen=True)
class Device:
    """A schedulable GPU (a physical GPU or a MIG instance) as the core sees it.

    ``group`` names a set of well-connected devices (an NVLink clique or one PCIe switch);
    multi-GPU claims prefer devices of one group. ``parent`` is the physical GPU of a MIG
    instance. ``kernel_memory`` is what kernels hold here outside their leases, as
    ``(kernel_id, bytes)`` pairs (a kernel that gave its lease back and kept its memory): that
    memory counts as taken for every claim but the kernel's own.
    """

    uuid: str
    index: int
    name: str = "GPU"
    memory_total: int = 80 * GiB
    health: Health = Health.OK
    group: str | None = None
    parent: str | None = None
    utilization: float | None = None
    memory_used: int | None = None
    kernel_memory: tuple[tuple[str, int], ...] = ()

    @property
    def schedulable(self) -> bool:
        return self.health == Health.OK


@dataclass(frozen=True)
class Lease:
    """A claim and, once granted, the lease on its devices.

    ``last_active_at`` is the last moment the kernel executed code or used its GPU; every idle
    clock runs from it. ``gaps`` holds the kernel's recent idle spells (seconds) that the adaptive
    idle timeout learns from. ``home`` lists the devices a suspended lease last ran on, so that a
    restore can go back there. ``memory_held`` is what the kernel's processes held on the GPU
    when last seen (``None``: unknown); a suspended lease keeps it as the size of its checkpoint.
    ``tried_steps`` are the reclaim steps already tried since the kernel last ran (a free-cache
    step taken because the lease is over its memory share counts until it is back within it).
    ``over_share_since`` is when a pass first saw a shared lease's processes hold more than its
    memory share (``None``: within it, or never seen over); see ``core/ladder.py``.
    """

    id: str
    kernel_id: str
    user: str
    count: int = 1
    memory: int | None = None
    mode: str = EXCLUSIVE
    priority: int = 0
    created_at: float = 0.0
    groups: tuple[str, ...] = ()
    state: LeaseState = LeaseState.PENDING
    devices: tuple[str, ...] = ()
    queued_at: float = 0.0
    granted_at: float | None = None
    last_active_at: float | None = None
    busy: bool = False
    reclaim_at: float | None = None
    reclaim_step: Step | None = None
    keep_until: float | None = None
    home: tuple[str, ...] = ()
    memory_held: int | None = None
    tried_steps: tuple[Step, ...] = ()
    gaps: tuple[float, ...] = ()
    released_at: float | None = None
    reason: str = ""
    version: int = 0
    over_share_since: float | None = None

    @property
    def holding(self) -> bool:
        return self.state in HOLDING

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def waiting(self) -> bool:
        return self.state == LeaseState.PENDING

    def idle_seconds(self, now: float) -> float:
        """Seconds since the kernel last executed or used its GPU (0 while busy)."""
        if self.busy or self.last_active_at is None:
            return 0.0
        return max(0.0, now - self.last_active_at)

    def promised_memory(self, device: Device) -> int:
        """Bytes of ``device`` this lease has been promised."""
        if self.mode == EXCLUSIVE or self.memory is None:
            return device.memory_total
        return self.memory


_LEASE_FIELDS = frozenset(f.name for f in fields(Lease))


def evolve(lease: Lease, **changes: object) -> Lease:
    """``dataclasses.replace(lease, **changes)``, for the scheduling pass's hot paths.

    A lease has only plain fields (no ``__post_init__``, nothing derived), so copying its fields
    and setting the changed ones gives the very record ``replace`` would build, without a call to
    the generated ``__init__`` that sets two dozen frozen fields one by one.
    """
    unknown = changes.keys() - _LEASE_FIELDS
    if unknown:
        raise TypeError(f"Lease has no field {', '.join(sorted(unknown))}")
    new = object.__new__(Lease)
    attrs = new.__dict__
    attrs.update(lease.__dict__)
    attrs.update(changes)
    return new


@dataclass(frozen=True)
class KernelActivity:
    """What the arbiter observed of one kernel in this tick.

    ``gpu_utilization`` is the kernel's own processes' share of the GPU in percent over the last
    poll interval (``None`` where the driver cannot tell); ``gpu_memory`` the bytes its processes
    hold on GPUs (``None`` if unknown, which the ladder treats as "holds memory").
    """

    kernel_id: str
    busy: bool = False
    last_busy_at: float | None = None
    gpu_utilization: float | None = None
    gpu_memory: int | None = None
    alive: bool = True
    started_at: float | None = None


@dataclass(frozen=True)
class Capabilities:
    """What the host's driver can do, found at start-up."""

    checkpoint: bool = False
    checkpoint_reason: str = "no checkpoint support detected"
    remap: bool = False
    #: Devices (uuid -> why, in words for the user) on which the checkpointer cannot take a
    #: checkpoint although it can elsewhere: the ladder skips the checkpoint step for a lease on
    #: any of them. MIG instances (``Device.parent`` set) are added by the core itself
    #: (``ladder.serving``).
    no_checkpoint: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class SchedConfig:
    """The scheduling knobs; defaults match ``GPUSchedApp`` (the server's settings, config.py)."""

    policy: str = "hybrid"
    idle_timeout: float = 300.0
    contended_idle_timeout: float = 60.0
    release_timeout: float = 3600.0
    grace_period: float = 60.0
    reclaim_fallback: str = "restart"
    checkpoint: str = "auto"
    idle_utilization_threshold: float = 5.0
    max_keep: float = 7200.0
    quotas: Mapping[str, float] = field(default_factory=dict)
    #: Learn each kernel's idle spells and adapt its timeouts (core/idle.py).
    adaptive: bool = True
    #: A claim blocked at the head of the fair queue for this long stops smaller claims from
    #: jumping ahead of it (so that a large claim never starves).
    backfill_wait: float = 120.0
    #: At most this many pending claims per user (0 = no cap).
    max_pending_per_user: int = 0
    #: Bytes of host memory that checkpoints may hold together (``None``: no limit). A checkpoint
    #: that would go over it is not taken; the reclaim ladder goes on to its next step.
    checkpoint_host_memory: int | None = None
    #: Seconds in which a user's (and a group's) recent GPU usage decays by half; it orders the
    #: queue after quota and picks which borrowed lease goes first (0: usage is not tracked).
    usage_half_life: float = 86400.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise SchedulingError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.reclaim_fallback not in FALLBACKS:
            raise SchedulingError(
                f"reclaim_fallback must be one of {', '.join(FALLBACKS)}, not {self.reclaim_fallback!r}"
            )
        if self.checkpoint not in ("auto", "off"):
            raise SchedulingError(f"checkpoint must be 'auto' or 'off', not {self.checkpoint!r}")
        for name in ("idle_timeout", "contended_idle_timeout", "release_timeout", "grace_period", "max_keep"):
            if getattr(self, name) < 0:
                raise SchedulingError(f"{name} must be 0 or more seconds")
        if self.checkpoint_host_memory is not None and self.checkpoint_host_memory < 0:
            raise SchedulingError("checkpoint_host_memory must be 0 or more bytes")
        if not self.usage_half_life >= 0 or math.isinf(self.usage_half_life):
            raise SchedulingError(
                f"usage_half_life must be 0 (usage not tracked) or a finite number of seconds, not {self.usage_half_life!r}"
            )


@dataclass(frozen=True)
class Decision:
    """One thing the core decided, with the lease record as it is after the decision.

    ``kind`` is one of: ``grant``, ``queue`` (position changed), ``active``, ``idle``,
    ``reclaim`` (carry out ``lease.reclaim_step`` now), ``notice`` (a disruptive reclaim is
    announced for ``lease.reclaim_at``), ``cancel`` (an announced reclaim is off), ``expire-keep``,
    ``over_share`` (a shared lease is over its memory share: what happens next is in the reason).
    """

    kind: str
    lease: Lease
    reason: str
    position: int | None = None


@dataclass(frozen=True)
class Plan:
    """The outcome of one scheduling pass.

    ``leases`` holds every lease record after the pass, ``changed`` the ids of those that differ
    from the input (the arbiter persists exactly those), ``queue`` the pending lease ids in fair
    order and ``next_wakeup`` the earliest time at which a pass could decide something new
    without new input (``None``: nothing scheduled).
    """

    decisions: tuple[Decision, ...]
    leases: tuple[Lease, ...]
    changed: tuple[str, ...]
    queue: tuple[str, ...]
    next_wakeup: float | None
    #: The fair queue's key of each waiting claim, and the recent usage (subject -> GPU-seconds)
    #: the pass ordered by: what ``fairness.explain`` says why each claim stands where it does from.
    keys: Mapping[str, tuple] = field(default_factory=dict)
    usage: Mapping[str, float] = field(default_factory=dict)

    def lease(self, lease_id: str) -> Lease | None:
        index = self.__dict__.get("_index")
        if index is None:
            index = {lease.id: lease for lease in self.leases}
            object.__setattr__(self, "_index", index)
        return index.get(lease_id)

    def position(self, lease_id: str) -> int | None:
        """1-based place of a pending lease in the fair queue."""
        try:
            return self.queue.index(lease_id) + 1
        except ValueError:
            return None
