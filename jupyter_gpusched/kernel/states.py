"""The states of a lease and the steps of a reclaim, as the server's lease JSON spells them.

One place for the names (the lease JSON of the OpenAPI document, api/openapi.py): the agent, the notices and the renderers compare a
lease's ``state`` and ``reclaim_step`` with these members: the same enums as the core's (``jupyter_gpusched.names``, which imports nothing), ``str`` enums, so a member equals the string the server sends
(``LeaseState.ACTIVE == "active"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..names import LeaseState, Step

#: ``state`` of a lease, and ``reclaim_step`` of one that is ``reclaiming`` (the core's own names).
ReclaimStep = Step


#: The lease holds its GPUs.
HOLDING: tuple[LeaseState, ...] = (LeaseState.ACTIVE, LeaseState.IDLE, LeaseState.RECLAIMING)
#: The lease is not over: it holds GPUs, waits for them, or keeps a checkpoint to restore.
LIVE: tuple[LeaseState, ...] = (*HOLDING, LeaseState.PENDING, LeaseState.SUSPENDED)
#: Reclaim steps that end the kernel's process and lose its variables.
DISRUPTIVE_STEPS: tuple[ReclaimStep, ...] = (ReclaimStep.RESTART, ReclaimStep.SHUTDOWN)


def state_of(lease: Mapping[str, Any] | None) -> LeaseState | None:
    """The lease's state (``None`` for no lease, or a state this version does not know)."""
    if not lease:
        return None
    try:
        return LeaseState(lease.get("state"))
    except ValueError:
        return None


def step_of(lease: Mapping[str, Any] | None) -> ReclaimStep | None:
    """The lease's reclaim step (``None`` when there is none, or one this version does not know)."""
    if not lease:
        return None
    try:
        return ReclaimStep(lease.get("reclaim_step"))
    except ValueError:
        return None
