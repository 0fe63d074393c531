"""What to do before a cell runs: a pure function of the lease, the flags, the settings and the time.

:func:`decide` reads the kernel's lease as the pre-run hook found it and says what the hook does:
bind to the lease's GPUs, restore a checkpoint, wait for a checkpoint under way, claim a GPU, or
nothing. It keeps no state and does nothing; :mod:`.hooks` carries the action out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .states import HOLDING, LeaseState, ReclaimStep

if TYPE_CHECKING:
    from .settings import Settings

#: What the hook says it waits for when a claim replaces a lease taken back.
TAKEN_BACK = "a GPU (the last one was taken back)"


class Do(str, Enum):
    """What the pre-run hook does."""

    #: The lease holds GPUs: point CUDA at them.
    BIND = "bind"
    #: The kernel's GPU state is checkpointed: restore it onto a GPU.
    RESUME = "resume"
    #: A checkpoint is under way: wait for it to land, then decide again.
    WAIT_CHECKPOINT = "wait-checkpoint"
    #: Claim a GPU (``Action.claim``) and wait for it.
    CLAIM = "claim"
    #: Nothing.
    NOTHING = "nothing"

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Flags:
    """What the kernel did with its leases (from the lease cache, and the hook's backoff)."""

    #: The user released the lease: the kernel asks for none by itself until told to.
    user_released: bool = False
    #: The kernel has held a GPU since it started.
    had_lease: bool = False
    #: Ids of leases this kernel released or withdrew itself.
    released_by_me: frozenset[str] = field(default_factory=frozenset)
    #: The last claim made (``count``, ``memory``, ``mode``, ``priority``).
    last_claim: Mapping[str, Any] | None = None
    #: After a failed automatic claim, no new one before this time.
    retry_at: float = 0.0


@dataclass(frozen=True)
class Action:
    """What to do before the cell, and why."""

    do: Do
    reason: str
    #: The claim to make (``count``, ``memory``, ``mode``, ``priority``), for :attr:`Do.CLAIM`.
    claim: Mapping[str, Any] | None = None
    #: What the wait line says is waited for, for :attr:`Do.CLAIM`.
    what: str = ""
    #: Hide the old lease's GPUs before claiming.
    unbind: bool = False


def params_of(lease: Mapping[str, Any]) -> dict[str, Any]:
    """The claim that asks for what ``lease`` holds (or held)."""
    return {
        "count": int(lease.get("count") or 1),
        "memory": lease.get("memory"),
        "mode": lease.get("mode") or "exclusive",
        "priority": None,
    }


def checkpointing(lease: Mapping[str, Any] | None) -> bool:
    """Whether a checkpoint of the lease is under way."""
    return bool(
        lease and lease.get("state") == LeaseState.RECLAIMING and lease.get("reclaim_step") == ReclaimStep.CHECKPOINT
    )


def decide(lease: Mapping[str, Any] | None, flags: Flags, settings: Settings, now: float) -> Action:
    """What the pre-run hook does before a cell, given the kernel's lease as it found it."""
    state = lease.get("state") if lease else None
    if checkpointing(lease):
        return Action(Do.WAIT_CHECKPOINT, "a checkpoint is under way; the restore follows it")
    if state in HOLDING:
        return Action(Do.BIND, "the lease holds its GPUs")
    if state == LeaseState.SUSPENDED:
        return Action(Do.RESUME, "the kernel's GPU state is checkpointed")
    if state == LeaseState.PENDING:
        if settings.auto_bind and not flags.user_released:
            return Action(Do.CLAIM, "the claim waits in the queue", params_of(lease), "a GPU")
        return Action(Do.NOTHING, "the claim waits in the queue; the user asked for it")
    if flags.user_released:
        return Action(Do.NOTHING, "the user released the lease")
    if lease and state == LeaseState.RELEASED and lease.get("id") not in flags.released_by_me:
        return Action(Do.CLAIM, "the lease was taken back", params_of(lease), TAKEN_BACK, unbind=True)
    if state == LeaseState.RELEASED:
        lease = None  # withdrawn by this kernel: as if it never asked
    if lease is None and flags.had_lease and flags.last_claim:
        return Action(Do.CLAIM, "the last lease was taken back", dict(flags.last_claim), TAKEN_BACK)
    if lease is None and settings.lazy:
        if now < flags.retry_at:
            return Action(Do.NOTHING, "the last automatic claim failed; not again yet")
        params = {"count": settings.gpus, "memory": settings.memory, "mode": settings.mode, "priority": None}
        return Action(Do.CLAIM, "a lazily bound kernel claims its GPU before its first cell", params, "a GPU")
    return Action(Do.NOTHING, "no lease, and none to ask for by itself")
