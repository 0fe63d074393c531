"""The reclaim ladder: the cheapest step that frees a GPU (docs/layers.md: an idle reclaim)."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from .model import SHARED, Capabilities, Device, Lease, LeaseState, SchedConfig, Step
from .units import format_bytes


def checkpoint_bytes(leases: Iterable[Lease]) -> int:
    """Host memory that checkpoints hold: suspended leases, restores still waiting for a GPU,
    and checkpoints being written (each counted at the GPU memory its kernel held)."""
    total = 0
    for lease in leases:
        state = lease.state
        if (
            state == LeaseState.SUSPENDED
            or (state == LeaseState.PENDING and lease.home)
            or (state == LeaseState.RECLAIMING and lease.reclaim_step == Step.CHECKPOINT)
        ):
            total += lease.memory_held or 0
    return total


def over_budget(lease: Lease, room: int | None) -> str | None:
    """Why checkpointing ``lease`` would go over ``checkpoint_host_memory`` (``room`` bytes are
    left of it; ``None``: no limit), or None where it fits."""
    if room is None:
        return None
    size = lease.memory_held or 0
    if size <= room:
        return None
    return (
        f"a checkpoint of {format_bytes(size)} would not fit in the host memory left for checkpoints "
        f"({format_bytes(max(room, 0))} left of what the checkpoint_host_memory setting allows)"
    )


#: How every reason about a MIG instance begins: the CUDA driver cannot checkpoint a process on
#: one (NVIDIA/cuda-checkpoint#42), so the ladder skips that step there.
MIG_REFUSED = "MIG instances cannot be checkpointed"


def mig_refusal(device: Device) -> str:
    """Why a kernel on MIG instance ``device`` cannot be checkpointed, in words for its user."""
    return (
        f"{MIG_REFUSED}: GPU {device.index} ({device.name}) is a MIG instance, and the CUDA driver "
        "cannot save a kernel's GPU state from one"
    )


def serving(caps: Capabilities, devices: Iterable[Device]) -> Capabilities:
    """``caps`` with every MIG instance among ``devices`` (``Device.parent`` set) added to the
    devices the checkpointer cannot serve (``caps`` itself when there is nothing to add)."""
    if not caps.checkpoint:
        return caps
    known = caps.no_checkpoint
    mig = {d.uuid: mig_refusal(d) for d in devices if d.parent is not None and d.uuid not in known}
    if not mig:
        return caps
    return replace(caps, no_checkpoint={**known, **mig})


def checkpoint_refused(lease: Lease, caps: Capabilities) -> str | None:
    """Why the checkpointer cannot serve ``lease`` (one of its GPUs, or of those it was
    checkpointed from, is one the checkpointer cannot serve), or None."""
    refused = caps.no_checkpoint
    if not refused:
        return None
    for uuid in lease.devices or lease.home:
        why = refused.get(uuid)
        if why:
            return why
    return None


#: How a reason says the kernel's GPU state cannot be kept (the steps that keep it do not apply).
NO_KEEPING = "its GPU state cannot be kept"
#: Why no checkpoint is taken on a server whose checkpoints are off.
CHECKPOINTS_OFF = "checkpoints are turned off on this server (the checkpoint setting)"
#: What a server whose fallback is ``none`` never does.
NEVER_DISRUPTS = "this server never restarts or shuts down a kernel to free a GPU (reclaim_fallback is 'none')"


def choose_step(
    lease: Lease, cfg: SchedConfig, caps: Capabilities, checkpoint_room: int | None = None
) -> tuple[Step | None, str]:
    """The step to take ``lease``'s GPUs back, or None where nothing may be done.

    ``checkpoint_room``: bytes of ``cfg.checkpoint_host_memory`` not yet held by checkpoints
    (``None``: no limit). A checkpoint that would not fit is skipped, and so is one on a GPU the
    checkpointer cannot serve (``caps.no_checkpoint``: MIG instances, see :func:`serving`); the
    reason of the step taken instead says so.
    """
    tried = set(lease.tried_steps)
    if lease.memory_held == 0 and Step.RELEASE not in tried:
        return Step.RELEASE, "the kernel holds no GPU memory"
    skipped = None
    if cfg.checkpoint == "auto" and caps.checkpoint:
        skipped = checkpoint_refused(lease, caps)
        if skipped is None and Step.CHECKPOINT not in tried:
            skipped = over_budget(lease, checkpoint_room)
            if skipped is None:
                return Step.CHECKPOINT, "the kernel's GPU state can be checkpointed to host memory"
    over = lease.memory is not None and (lease.memory_held or 0) > lease.memory
    if lease.mode == SHARED and over and Step.FREE_CACHE not in tried:
        how = "the kernel holds more than its share: dropping framework caches"
        return Step.FREE_CACHE, f"{skipped}; {how}" if skipped else how
    if cfg.checkpoint == "off":
        why = CHECKPOINTS_OFF
    else:
        why = skipped or caps.checkpoint_reason
    if cfg.reclaim_fallback == "restart":
        return Step.RESTART, f"{NO_KEEPING} (a restart is all that is left): {why}"
    if cfg.reclaim_fallback == "shutdown":
        return Step.SHUTDOWN, f"{NO_KEEPING} (a shutdown is all that is left): {why}"
    if skipped:
        return None, f"{skipped}, and {NEVER_DISRUPTS}"
    return None, f"nothing frees its GPU without losing the kernel's state, and {NEVER_DISRUPTS}"


# -- a shared lease over its memory share ------------------------------------------------------
#
# A shared lease is promised ``memory`` bytes on each of its GPUs, and the GPU is shared on that
# promise. When its processes hold more (as the GPUs report per process), the pass responds in
# this order (``_Pass.over_share`` in ``scheduler.py``):
#
# 1. a notice: ``over_share_since`` is set and the reason says so (decision ``over_share``);
# 2. at a pass at least ``OVER_SHARE_RECHECK`` seconds later, if it is still over: the
#    ``free-cache`` step (the kernel drops its frameworks' caches);
# 3. if it is still over after that: when the over-share can hurt someone (another lease holds
#    one of its GPUs, or a waiting claim could use one) the ``reclaim_fallback`` (restart or
#    shutdown) after a ``grace_period`` notice; when nobody is hurt, or the fallback is ``none``,
#    it keeps running and the reason says why.
#
# Back within its share at any point: the response stops, and an announced fallback is cancelled.

#: Bytes a shared lease may hold beyond its share before it counts as over it: a process's CUDA
#: context is counted in the per-process figure but lies outside every framework's memory pool
#: (whose limits are set to the share), and it takes a few hundred MiB on current GPUs.
OVER_SHARE_SLACK = 512 * 1024**2
#: Seconds between the notice and the free-cache step: the lease must still be over at a pass
#: this much later (a later observation, on a server whose ticks are no further apart).
OVER_SHARE_RECHECK = 1.0


def share_of(lease: Lease) -> int | None:
    """The bytes a shared lease is promised on all its GPUs together (None: not a shared share)."""
    if lease.mode != SHARED or lease.memory is None or not lease.devices:
        return None
    return lease.memory * len(lease.devices)


def over_share(lease: Lease) -> bool:
    """Whether ``lease``'s processes hold more than its share plus ``OVER_SHARE_SLACK``."""
    share = share_of(lease)
    if share is None or lease.memory_held is None or not lease.holding:
        return False
    return lease.memory_held > share + OVER_SHARE_SLACK
