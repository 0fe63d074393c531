"""Recent GPU usage per user and per group, decayed with a half-life (fair share with memory).

Each subject (``"user:alice"``, ``"group:ml"``) has a usage in GPU-seconds that decays
exponentially: after ``half_life`` seconds, half of it is left. While a subject holds ``g`` GPUs'
worth, its usage grows by ``g`` per second. Between two passes the GPUs held are constant, so
the integral is exact::

    u(t1) = u(t0) * 2**(-dt/h) + g * h / ln 2 * (1 - 2**(-dt/h)),   dt = t1 - t0

A lease counts each of its GPUs whole, except a ``shared`` lease with a memory size, which counts
its share of each GPU's memory (``memory / memory_total``, at most 1). A subject that holds nothing
and whose usage has decayed under :data:`FORGET_BELOW` GPU-seconds is forgotten.

The arbiter keeps one :class:`Accrued` per subject in the ledger and the simulator one per node,
and both go through :func:`recent` (usage now, for the pass) and :func:`advance` (the records
after the pass): the same history gives the same usage and so the same queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .model import EXCLUSIVE, HOLDING, Device, Lease

LN2 = math.log(2.0)

#: A subject holding nothing whose usage decayed below this many GPU-seconds is forgotten.
FORGET_BELOW = 1.0


@dataclass(frozen=True)
class Accrued:
    """One subject's usage as of ``as_of``: ``gpu_seconds`` decayed to then, and the GPUs' worth
    it has held since (``held``), which keeps accruing until the next pass."""

    gpu_seconds: float
    held: float
    as_of: float


def decay(gpu_seconds: float, held: float, dt: float, half_life: float) -> float:
    """Usage ``dt`` seconds later, holding ``held`` GPUs' worth all along (the formula above)."""
    if dt <= 0:
        return gpu_seconds
    if half_life <= 0:
        return 0.0
    left = 2.0 ** (-dt / half_life)
    return gpu_seconds * left + held * half_life / LN2 * (1.0 - left)


def subjects(user: str, groups: Iterable[str]) -> tuple[str, ...]:
    """The subjects a lease of ``user`` in ``groups`` counts towards."""
    return (f"user:{user}",) + tuple(f"group:{g}" for g in groups)


def held_by_subject(leases: Iterable[Lease], devices: Sequence[Device]) -> dict[str, float]:
    """GPUs' worth each subject holds in ``leases`` (a shared lease counts its memory share)."""
    memory = {d.uuid: d.memory_total for d in devices}
    out: dict[str, float] = {}
    for lease in leases:
        if lease.state not in HOLDING or not lease.devices:
            continue
        if lease.mode == EXCLUSIVE or lease.memory is None:
            worth = float(len(lease.devices))
        else:
            worth = 0.0
            for uuid in lease.devices:
                total = memory.get(uuid)
                worth += 1.0 if not total else min(1.0, lease.memory / total)
        for subject in subjects(lease.user, lease.groups):
            out[subject] = out.get(subject, 0.0) + worth
    return out


def recent(records: Mapping[str, Accrued], now: float, half_life: float) -> dict[str, float]:
    """Each subject's usage at ``now`` in GPU-seconds ({} when ``half_life`` is 0: not tracked)."""
    if half_life <= 0:
        return {}
    return {s: decay(r.gpu_seconds, r.held, now - r.as_of, half_life) for s, r in records.items()}


def advance(
    records: Mapping[str, Accrued],
    leases: Iterable[Lease],
    devices: Sequence[Device],
    now: float,
    half_life: float,
) -> dict[str, Accrued]:
    """The records after a pass at ``now``: usage accrued up to ``now`` with what each subject
    held since its record, and what it holds from now on according to ``leases`` (the pass's
    outcome). A record dated after ``now`` (another clock) is not decayed backwards."""
    if half_life <= 0:
        return {}
    held = held_by_subject(leases, devices)
    out: dict[str, Accrued] = {}
    for subject in records.keys() | held.keys():
        old = records.get(subject)
        if old is None:
            used, as_of = 0.0, now
        else:
            used = decay(old.gpu_seconds, old.held, now - old.as_of, half_life)
            as_of = max(now, old.as_of)
        holds = held.get(subject, 0.0)
        if holds <= 0 and used < FORGET_BELOW:
            continue
        out[subject] = Accrued(used, holds, as_of)
    return out


def gpu_hours(gpu_seconds: float) -> float:
    return gpu_seconds / 3600.0
