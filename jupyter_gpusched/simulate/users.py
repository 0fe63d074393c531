"""Each user's cell delays apart: who waits, how long, and why.

An average hides the user who waits minutes. A replay records, for every counted cell, how long it
waited in all and how much of that was a restore of its kernel's GPU state (the rest is the queue);
:func:`by_user` folds them per user, and :func:`worst` names the user whose p95 is the highest and
says why their late cells waited: in the queue (often for a claim of several GPUs at once), for
restores, or both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from ..core.units import format_duration
from .stats import percentile

#: A cell counts as late, for saying why a user waited, when it waited more than this.
LATE_S = 1.0
#: A cause is named alone when it is at least this share of the late cells' waiting.
DOMINANT = 0.8


@dataclass(frozen=True)
class UserDelays:
    user: str
    cells: int
    p95_s: float
    #: The most GPUs one of the user's kernels asks for at once.
    gpus_at_once: int
    #: Seconds the user's late cells waited in the queue, and for restores, in all.
    queue_s: float
    restore_s: float

    @property
    def why(self) -> str:
        """``queue``, ``restores``, ``both``, or ``none`` (no late cell)."""
        late = self.queue_s + self.restore_s
        if late <= 0:
            return "none"
        if self.queue_s >= DOMINANT * late:
            return "queue"
        if self.restore_s >= DOMINANT * late:
            return "restores"
        return "both"

    def describe(self) -> str:
        """The worst user in words, for the table's footnote."""
        large = f" for a claim of {self.gpus_at_once} GPUs at once" if self.gpus_at_once > 1 else ""
        reason = {
            "queue": f"waited in the queue{large}",
            "restores": "waited for restores of their kernels' GPU state",
            "both": f"waited in the queue{large} and for restores",
            "none": "no cell waited over a second",
        }[self.why]
        return (
            f"{self.user}: p95 {format_duration(self.p95_s)} over {self.cells} cells; {reason} "
            f"(late cells: {format_duration(self.queue_s)} queued, {format_duration(self.restore_s)} restoring)"
        )

    def as_json(self) -> dict:
        return {
            "cells": self.cells,
            "p95_s": round(self.p95_s, 2),
            "gpus_at_once": self.gpus_at_once,
            "queue_s": round(self.queue_s, 2),
            "restore_s": round(self.restore_s, 2),
            "why": self.why,
        }


def by_user(cells: Iterable[tuple[str, int, float, float]]) -> dict[str, UserDelays]:
    """``cells``: ``(user, GPUs its kernel asks for, delay, restore part of the delay)`` per cell."""
    delays: dict[str, list[float]] = {}
    gpus: dict[str, int] = {}
    queue: dict[str, float] = {}
    restore: dict[str, float] = {}
    for user, count, delay, restored in cells:
        delays.setdefault(user, []).append(delay)
        gpus[user] = max(gpus.get(user, 0), count)
        if delay > LATE_S:
            part = min(max(restored, 0.0), delay)
            restore[user] = restore.get(user, 0.0) + part
            queue[user] = queue.get(user, 0.0) + delay - part
    return {
        user: UserDelays(
            user, len(values), percentile(values, 95), gpus[user], queue.get(user, 0.0), restore.get(user, 0.0)
        )
        for user, values in delays.items()
    }


def worst(users: Mapping[str, UserDelays]) -> UserDelays | None:
    """The user with the highest p95 (the first by name among equals), or None for nobody."""
    if not users:
        return None
    return min(users.values(), key=lambda u: (-u.p95_s, -u.cells, u.user))
