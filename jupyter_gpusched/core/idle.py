"""Idle detection and adaptive idle timeouts.

A kernel is active while it executes a cell or its own processes use the GPU above
``idle_utilization_threshold``; every idle clock runs from the last such moment. Each time a kernel
comes back after an idle spell, the spell's length is remembered on its lease (``Lease.gaps``).

The adaptive timeouts read those spells (padded with the host's recent spells while a kernel has
few of its own) as a survival curve. At a candidate time ``t`` the question is: of the spells that
lasted longer than ``t``, how many lasted a further ``idle_timeout``? If most did, a kernel idle for
``t`` is probably gone for a while and its GPU is better used elsewhere. So a kernel whose pauses
are long is reclaimed sooner than ``idle_timeout``, and one that reliably returns a little after
``idle_timeout`` keeps its GPU until after it usually returns.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Sequence

from .model import KernelActivity, Lease, SchedConfig

#: Idle spells shorter than this are noise between two cells, not a pause.
MIN_GAP = 1.0
#: Idle spells remembered per kernel.
HISTORY = 32
#: Spells a kernel needs of its own before the host's spells stop padding its history.
OWN_SAMPLES = 6
#: Spells needed in all before timeouts adapt at all.
MIN_SAMPLES = 8
#: Share of long remainders at which a pause is judged to be a long one.
P_LONG = 0.6
#: The earliest an idle lease can count idle, as a fraction of ``idle_timeout``.
FLOOR = 0.25
#: Step between candidate times.
GROWTH = 1.25


@dataclass(frozen=True)
class Timeouts:
    """When a lease counts idle and when it may be reclaimed without disrupting anyone."""

    idle_after: float
    keep_after: float | None
    reason: str


def observe(lease: Lease, activity: KernelActivity | None, now: float, cfg: SchedConfig) -> Lease:
    """Fold one tick's observation of the kernel into its lease.

    While the kernel stays active the record does not change (no write per tick); the idle clock
    starts when activity ends.
    """
    if activity is None:
        return lease
    using_gpu = (
        activity.gpu_utilization is not None and activity.gpu_utilization >= cfg.idle_utilization_threshold
    )
    active_now = activity.busy or using_gpu
    last = lease.last_active_at
    gaps = lease.gaps
    began = activity.started_at
    if not lease.busy and last is not None:
        # An idle spell ended if the kernel ran since we last looked (perhaps a short cell that
        # began and ended between two ticks).
        resumed_at = began if began is not None and began > last else (now if active_now else None)
        if resumed_at is not None:
            gap = resumed_at - last
            if gap >= MIN_GAP:
                gaps = (*gaps, gap)[-HISTORY:]
    if active_now:
        if not lease.busy:
            last = now
    else:
        if activity.last_busy_at is not None and (last is None or activity.last_busy_at > last):
            last = min(activity.last_busy_at, now)
        elif lease.busy:
            last = now
    memory = activity.gpu_memory if activity.gpu_memory is not None else lease.memory_held
    if (active_now, last, gaps, memory) == (lease.busy, lease.last_active_at, lease.gaps, lease.memory_held):
        return lease
    tried = () if active_now else lease.tried_steps
    return replace(lease, busy=active_now, last_active_at=last, gaps=gaps, memory_held=memory, tried_steps=tried)


def record_gap(lease: Lease, now: float) -> tuple[float, ...]:
    """The lease's idle spells with the one that ends ``now`` added."""
    if lease.busy or lease.last_active_at is None:
        return lease.gaps
    gap = now - lease.last_active_at
    if gap < MIN_GAP:
        return lease.gaps
    return (*lease.gaps, gap)[-HISTORY:]


def _samples(lease: Lease, prior: Sequence[float]) -> list[float]:
    own = list(lease.gaps)
    if len(own) >= OWN_SAMPLES:
        return sorted(own)
    return sorted(own + list(prior))


def _first_long_point(samples: list[float], start: float, stop: float, horizon: float) -> float | None:
    """Smallest candidate ``t`` in [start, stop] at which a pause past ``t`` is probably long."""
    n = len(samples)
    t = start
    while t <= stop + 1e-9:
        beyond_t = n - bisect.bisect_right(samples, t)
        if beyond_t == 0:
            return t
        beyond_horizon = n - bisect.bisect_right(samples, t + horizon)
        if beyond_horizon / beyond_t >= P_LONG:
            return t
        t *= GROWTH
    return None


def timeouts(lease: Lease, prior: Sequence[float], cfg: SchedConfig) -> Timeouts:
    """The adaptive idle timeouts of ``lease`` (``keep_after`` None: keep while nobody waits)."""
    base_keep = cfg.release_timeout if cfg.release_timeout > 0 else None
    if cfg.policy == "static":
        return Timeouts(cfg.idle_timeout, None, "static policy: leases are held until the kernel ends")
    samples = _samples(lease, prior) if cfg.adaptive else []
    if len(samples) < MIN_SAMPLES or cfg.idle_timeout <= 0:
        return Timeouts(cfg.idle_timeout, base_keep, "idle_timeout (too few idle spells to learn from)")
    horizon = cfg.idle_timeout
    early = _first_long_point(samples, max(cfg.idle_timeout * FLOOR, 1.0), cfg.idle_timeout / GROWTH, horizon)
    idle_after = early if early is not None else cfg.idle_timeout
    if base_keep is None:
        # release_timeout = 0: an idle lease is kept for as long as nobody waits.
        keep = None
    else:
        keep = _first_long_point(samples, idle_after, base_keep, horizon)
        if keep is None:
            keep = base_keep
    if early is not None:
        reason = f"pauses are usually long: idle after {idle_after:.0f}s"
    elif keep is not None and keep > idle_after * GROWTH:
        reason = f"returns quickly: kept up to {keep:.0f}s while idle"
    else:
        reason = "idle_timeout"
    return Timeouts(idle_after, keep, reason)


def host_prior(leases: Sequence[Lease], limit: int = 256) -> list[float]:
    """Recent idle spells of all kernels, to pad the history of kernels that have few."""
    spells: list[float] = []
    for lease in leases:
        spells.extend(lease.gaps[-8:])
    return spells[-limit:]
