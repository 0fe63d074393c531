"""The reclaim ladder: the cheapest step that frees a GPU (DESIGN section 6)."""

from __future__ import annotations

from typing import Iterable

from .model import SHARED, Capabilities, Lease, LeaseState, SchedConfig, Step
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
        f"a checkpoint of {format_bytes(size)} would go over checkpoint_host_memory "
        f"({format_bytes(max(room, 0))} of it left)"
    )


def choose_step(
    lease: Lease, cfg: SchedConfig, caps: Capabilities, checkpoint_room: int | None = None
) -> tuple[Step | None, str]:
    """The step to take ``lease``'s GPUs back, or None where nothing may be done.

    ``checkpoint_room``: bytes of ``cfg.checkpoint_host_memory`` not yet held by checkpoints
    (``None``: no limit). A checkpoint that would not fit is skipped, and the reason of the step
    taken instead says so.
    """
    tried = set(lease.tried_steps)
    if lease.memory_held == 0 and Step.RELEASE not in tried:
        return Step.RELEASE, "the kernel holds no GPU memory"
    skipped = None
    if Step.CHECKPOINT not in tried and cfg.checkpoint == "auto" and caps.checkpoint:
        skipped = over_budget(lease, checkpoint_room)
        if skipped is None:
            return Step.CHECKPOINT, "the kernel's GPU state can be checkpointed to host memory"
    over = lease.memory is not None and (lease.memory_held or 0) > lease.memory
    if lease.mode == SHARED and over and Step.FREE_CACHE not in tried:
        how = "the kernel holds more than its share: dropping framework caches"
        return Step.FREE_CACHE, f"{skipped}; {how}" if skipped else how
    if cfg.checkpoint == "off":
        why = "checkpoint is off"
    else:
        why = skipped or caps.checkpoint_reason
    if cfg.reclaim_fallback == "restart":
        return Step.RESTART, f"no gentler step: {why}"
    if cfg.reclaim_fallback == "shutdown":
        return Step.SHUTDOWN, f"no gentler step: {why}"
    if skipped:
        return None, f"{skipped}, and reclaim_fallback is 'none'"
    return None, "reclaim_fallback is 'none' and no gentler step applies"
