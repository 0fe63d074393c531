"""Names the lease JSON spells as strings: a lease's state and a reclaim's step.

One place for them, imported by the core and by the kernel side alike; it imports nothing, so a
kernel that loads it loads no scheduling code.
"""

from __future__ import annotations

import enum


class Name(str, enum.Enum):
    """A name the JSON spells as a string: a member equals, prints and formats as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class LeaseState(Name):
    """Where a lease stands in its lifecycle (docs/layers.md; the states of ``api/schemas.py``'s Lease)."""

    PENDING = "pending"
    ACTIVE = "active"
    IDLE = "idle"
    RECLAIMING = "reclaiming"
    SUSPENDED = "suspended"
    RELEASED = "released"


class Step(Name):
    """Steps of the reclaim ladder, cheapest first (core/ladder.py)."""

    RELEASE = "release"
    CHECKPOINT = "checkpoint"
    FREE_CACHE = "free-cache"
    RESTART = "restart"
    SHUTDOWN = "shutdown"

    @property
    def disruptive(self) -> bool:
        """Whether the step loses the kernel's state."""
        return self in (Step.RESTART, Step.SHUTDOWN)
