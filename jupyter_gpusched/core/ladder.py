"""The reclaim ladder: the cheapest step that frees a GPU (DESIGN section 6)."""

from __future__ import annotations

from .model import SHARED, Capabilities, Lease, SchedConfig, Step


def choose_step(lease: Lease, cfg: SchedConfig, caps: Capabilities) -> tuple[Step | None, str]:
    """The step to take ``lease``'s GPUs back, or None where nothing may be done."""
    tried = set(lease.tried_steps)
    if lease.memory_held == 0 and Step.RELEASE not in tried:
        return Step.RELEASE, "the kernel holds no GPU memory"
    if Step.CHECKPOINT not in tried and cfg.checkpoint == "auto" and caps.checkpoint:
        return Step.CHECKPOINT, "the kernel's GPU state can be checkpointed to host memory"
    over = lease.memory is not None and (lease.memory_held or 0) > lease.memory
    if lease.mode == SHARED and over and Step.FREE_CACHE not in tried:
        return Step.FREE_CACHE, "the kernel holds more than its share: dropping framework caches"
    if cfg.reclaim_fallback == "restart":
        why = "checkpoint is off" if cfg.checkpoint == "off" else caps.checkpoint_reason
        return Step.RESTART, f"no gentler step: {why}"
    if cfg.reclaim_fallback == "shutdown":
        why = "checkpoint is off" if cfg.checkpoint == "off" else caps.checkpoint_reason
        return Step.SHUTDOWN, f"no gentler step: {why}"
    return None, "reclaim_fallback is 'none' and no gentler step applies"
