"""Lease transitions outside the scheduling pass: claims, suspend, resume, keep, release.

Each function checks that the transition is allowed, and returns the new record; the caller
persists it. Nothing here reads a clock: ``now`` is passed in.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from .model import (
    EXCLUSIVE,
    HOLDING,
    MODES,
    ConflictError,
    Device,
    Lease,
    LeaseState,
    NoCapacity,
    SchedConfig,
    SchedulingError,
    Step,
)
from .idle import record_gap
from .placement import capacity_for, schedulable
from .units import format_bytes


def new_claim(
    lease_id: str,
    kernel_id: str,
    user: str,
    now: float,
    *,
    count: object = 1,
    memory: int | None = None,
    mode: object = EXCLUSIVE,
    priority: object = 0,
    groups: Iterable[str] = (),
    gaps: Sequence[float] = (),
) -> Lease:
    """A pending lease for a claim, with its fields checked."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise SchedulingError(f"count must be a whole number of GPUs, not {count!r}")
    if count < 1:
        raise SchedulingError(f"count must be at least 1 GPU, not {count}")
    if mode not in MODES:
        raise SchedulingError(f"mode must be 'exclusive' or 'shared', not {mode!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise SchedulingError(f"priority must be a whole number, not {priority!r}")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
        raise SchedulingError(f"memory must be a positive number of bytes, not {memory!r}")
    if not kernel_id or not isinstance(kernel_id, str):
        raise SchedulingError("kernel_id must be a non-empty string")
    return Lease(
        id=lease_id,
        kernel_id=kernel_id,
        user=user,
        count=count,
        memory=memory,
        mode=str(mode),
        priority=priority,
        groups=tuple(groups),
        created_at=now,
        queued_at=now,
        last_active_at=now,
        gaps=tuple(gaps),
        reason="waiting for a GPU",
    )


def admit(claim: Lease, devices: Sequence[Device], leases: Iterable[Lease], cfg: SchedConfig) -> None:
    """Raise a clear error if ``claim`` can never be served or clashes with live leases."""
    leases = list(leases)
    healthy = schedulable(devices)
    if not healthy:
        if devices:
            raise NoCapacity("every GPU on this host is drained or lost; none can be granted now")
        raise NoCapacity("this host has no GPUs to schedule")
    if claim.memory is not None:
        largest = max(d.memory_total for d in healthy)
        if claim.memory > largest:
            raise SchedulingError(
                f"memory {format_bytes(claim.memory)} per GPU is more than the largest GPU here "
                f"({format_bytes(largest)})"
            )
    room = capacity_for(claim, devices)
    if claim.count > room:
        total = len(healthy)
        raise SchedulingError(
            f"asked for {claim.count} GPU{'s' if claim.count != 1 else ''} but only {room} of the "
            f"{total} healthy GPU{'s' if total != 1 else ''} here could hold such a claim"
        )
    for lease in leases:
        if lease.kernel_id == claim.kernel_id and lease.live and lease.id != claim.id:
            raise ConflictError(
                f"kernel {claim.kernel_id} already has lease {lease.id} ({lease.state.value}); "
                "release it first or use it"
            )
    if cfg.max_pending_per_user > 0:
        pending = sum(
            1 for le in leases if le.user == claim.user and le.state == LeaseState.PENDING and le.id != claim.id
        )
        if pending >= cfg.max_pending_per_user:
            raise ConflictError(
                f"user {claim.user} already has {pending} claims waiting (the limit is "
                f"{cfg.max_pending_per_user}); release or wait for one first"
            )


def suspended(lease: Lease, now: float, memory_held: int | None = None) -> Lease:
    """The GPU state was checkpointed: the devices are free, the kernel keeps its claim."""
    if lease.state not in HOLDING:
        raise ConflictError(f"lease {lease.id} is {lease.state.value}; only a held lease can be suspended")
    held = memory_held if memory_held is not None else lease.memory_held
    return replace(
        lease,
        state=LeaseState.SUSPENDED,
        home=lease.devices,
        devices=(),
        memory_held=held,
        reclaim_at=None,
        reclaim_step=None,
        busy=False,
        reason="suspended: GPU state checkpointed to host memory; the next cell restores it",
        version=lease.version + 1,
    )


def request_resume(lease: Lease, now: float) -> Lease:
    """The kernel wants to run again: a suspended lease joins the queue to be restored."""
    if lease.state != LeaseState.SUSPENDED:
        raise ConflictError(f"lease {lease.id} is {lease.state.value}, not suspended")
    return replace(
        lease,
        state=LeaseState.PENDING,
        queued_at=now,
        gaps=record_gap(lease, now),
        last_active_at=now,
        reason="waiting for a GPU to restore onto",
        version=lease.version + 1,
    )


def restore_deferred(lease: Lease, now: float, reason: str) -> Lease:
    """A restore granted GPUs could not be carried out there (too little free memory when it
    came to it, or GPUs the checkpointer cannot map onto): the lease waits again, in its place in
    the queue, with its checkpoint kept."""
    if lease.state not in HOLDING or not lease.home:
        raise ConflictError(f"lease {lease.id} is {lease.state.value}, not a restore under way")
    return replace(
        lease,
        state=LeaseState.PENDING,
        devices=(),
        granted_at=None,
        busy=False,
        reclaim_at=None,
        reclaim_step=None,
        reason=reason,
        version=lease.version + 1,
    )


def released(lease: Lease, now: float, reason: str) -> Lease:
    """The lease is over; released twice is released once."""
    if lease.state == LeaseState.RELEASED:
        return lease
    return replace(
        lease,
        state=LeaseState.RELEASED,
        devices=(),
        released_at=now,
        reclaim_at=None,
        reclaim_step=None,
        busy=False,
        reason=reason,
        version=lease.version + 1,
    )


def _out_of_reclaim(lease: Lease, state: LeaseState, reason: str, **changes: object) -> Lease:
    """A reclaiming lease back in ``state`` with no reclaim planned (any other lease unchanged)."""
    if lease.state != LeaseState.RECLAIMING:
        return lease
    return replace(
        lease, state=state, reclaim_at=None, reclaim_step=None, reason=reason, version=lease.version + 1, **changes
    )


def _step_over(lease: Lease, step: Step, reason: str) -> Lease:
    """Back to idle with ``step`` marked tried, so that the next pass goes on down the ladder."""
    return _out_of_reclaim(lease, LeaseState.IDLE, reason, tried_steps=(*lease.tried_steps, step))


def step_failed(lease: Lease, step: Step, reason: str) -> Lease:
    """A reclaim step could not be carried out: the next pass tries the next one."""
    return _step_over(lease, step, f"{step.value} failed: {reason}")


def called_off(lease: Lease, now: float, reason: str) -> Lease:
    """A reclaim not begun yet is called off because the kernel runs a cell again: the lease is
    active and busy from ``now`` (the next pass looks at the kernel afresh)."""
    return _out_of_reclaim(lease, LeaseState.ACTIVE, reason, busy=True, last_active_at=now)


def lock_timed_out(lease: Lease, now: float, reason: str) -> Lease:
    """A checkpoint whose lock timed out: the kernel's GPU work did not pause in time, so nothing
    was checkpointed and the kernel runs on. The lease is active again and counted in use at
    ``now`` (the kernel was using its GPU), which restarts its idle clock: a pass takes it back
    again only once it has been idle as long as it must be from there (``contended_idle_timeout``
    when someone waits, its idle timeout otherwise), not at once (unless that timeout is 0),
    and with the same ladder, so the checkpoint is tried again before any disruptive step."""
    return _out_of_reclaim(lease, LeaseState.ACTIVE, reason, busy=False, last_active_at=now)


def step_skipped(lease: Lease, step: Step, reason: str) -> Lease:
    """A step that was due could not be taken now (a checkpoint over ``checkpoint_host_memory``):
    the next pass tries the next one."""
    return _step_over(lease, step, f"{step.value} not taken: {reason}")


def step_done(lease: Lease, step: Step, reason: str) -> Lease:
    """A step that frees memory but not the device (``free-cache``) was carried out."""
    return _step_over(lease, step, reason)


def keep(lease: Lease, seconds: float, now: float, cfg: SchedConfig) -> Lease:
    """Pin a lease against idle reclaim for ``seconds`` (at most ``max_keep``); 0 unpins."""
    if not lease.live:
        raise ConflictError(f"lease {lease.id} is released; there is nothing to keep")
    if seconds < 0:
        raise SchedulingError("keep needs 0 or more seconds")
    if seconds > cfg.max_keep:
        raise SchedulingError(
            f"keep is limited to {cfg.max_keep:.0f} seconds on this server (asked for {seconds:.0f})"
        )
    until = now + seconds if seconds > 0 else None
    state = lease.state
    reason = lease.reason
    # Only an announced (disruptive) reclaim can be called off; a release or checkpoint the
    # arbiter is carrying out already finishes, as it does when the kernel runs again.
    under_way = lease.reclaim_step is not None and not lease.reclaim_step.disruptive
    # Nor does a keep call off what a lease over its memory share is due for: keep is against
    # idle reclaim, not a licence to hold more than the share.
    under_way = under_way or lease.over_share_since is not None
    if state == LeaseState.RECLAIMING and until is not None and not under_way:
        state = LeaseState.ACTIVE
        reason = "reclaim cancelled: kept by the user"
    return replace(
        lease,
        keep_until=until,
        state=state,
        reclaim_at=None if state != LeaseState.RECLAIMING else lease.reclaim_at,
        reclaim_step=None if state != LeaseState.RECLAIMING else lease.reclaim_step,
        last_active_at=now if until is not None else lease.last_active_at,
        reason=reason,
        version=lease.version + 1,
    )


def device_lost(lease: Lease, uuid: str, index: int, now: float) -> Lease:
    """A device of the lease fell off the bus: the lease cannot be used any more."""
    return released(lease, now, f"GPU {index} ({uuid}) was lost; the kernel's GPU state on it is gone")


def touch(lease: Lease, now: float) -> Lease:
    """The kernel is about to run a cell on a held lease."""
    if lease.state not in HOLDING:
        return lease
    return replace(lease, last_active_at=now, version=lease.version + 1)
