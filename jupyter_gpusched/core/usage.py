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
and both go through a :class:`Book`: :meth:`Book.recent` (usage now, for the pass) and
:meth:`Book.advance` (the records after the pass). The same history gives the same usage and so
the same queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

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


def value(record: Accrued, now: float, half_life: float) -> float:
    """A record's usage at ``now``; 0 once it holds nothing and has decayed under :data:`FORGET_BELOW`
    (whether or not the record has been swept away yet)."""
    used = decay(record.gpu_seconds, record.held, now - record.as_of, half_life)
    if record.held <= 0 and used < FORGET_BELOW:
        return 0.0
    return used


class Recent(Mapping[str, float]):
    """Each subject's usage at ``now`` in GPU-seconds, worked out when asked (a pass asks only for
    the users that wait or borrow). It reads ``records`` as they are when asked."""

    def __init__(self, records: Mapping[str, Accrued], now: float, half_life: float) -> None:
        self._records = records if half_life > 0 else {}
        self._now = now
        self._half_life = half_life
        self._known: dict[str, float] = {}

    def __getitem__(self, subject: str) -> float:
        known = self._known.get(subject)
        if known is None:
            known = self._known[subject] = value(self._records[subject], self._now, self._half_life)
        return known

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)


def recent(records: Mapping[str, Accrued], now: float, half_life: float) -> Recent:
    """Each subject's usage at ``now`` (empty when ``half_life`` is 0: not tracked)."""
    return Recent(records, now, half_life)


class Book:
    """The usage records of one scheduler (a ledger's, a simulated node's), kept across passes.

    A record is exact for as long as its subject holds the same GPUs' worth, so after a pass only
    the records of subjects whose holdings changed are written again (:meth:`advance`): the cost
    of a pass grows with those who hold GPUs, not with everyone who ever used one. Records that
    count as 0 (:func:`value`) leave in :meth:`forget`, which changes no decision.
    """

    def __init__(self, records: Mapping[str, Accrued] | None = None) -> None:
        self.records: dict[str, Accrued] = dict(records or {})
        self._holders = {s for s, r in self.records.items() if r.held > 0}

    def recent(self, now: float, half_life: float) -> Recent:
        """Usage at ``now`` for a pass (valid until the next :meth:`advance`)."""
        return Recent(self.records, now, half_life)

    def advance(
        self, leases: Iterable[Lease], devices: Sequence[Device], now: float, half_life: float
    ) -> dict[str, Accrued]:
        """After a pass at ``now`` that left ``leases``: accrue up to ``now`` the usage of each
        subject whose GPUs held changed, and record what it holds from now on. Returns the
        records written (a record dated after ``now``, from another clock, is not decayed back)."""
        if half_life <= 0:
            return {}
        held = held_by_subject(leases, devices)
        written: dict[str, Accrued] = {}
        records, holders = self.records, self._holders
        for subject in sorted(holders | held.keys()):
            holds = held.get(subject, 0.0)
            old = records.get(subject)
            if old is not None and old.held == holds:
                continue
            if old is None:
                record = Accrued(0.0, holds, now)
            else:
                used = decay(old.gpu_seconds, old.held, now - old.as_of, half_life)
                record = Accrued(used, holds, max(now, old.as_of))
            records[subject] = written[subject] = record
            if holds > 0:
                holders.add(subject)
            else:
                holders.discard(subject)
        return written

    def forget(self, now: float, half_life: float) -> list[str]:
        """Drop the records that count as 0 at ``now``; returns their subjects."""
        gone = [s for s, r in self.records.items() if r.held <= 0 and value(r, now, half_life) == 0.0]
        for subject in gone:
            del self.records[subject]
        return gone


def gpu_hours(gpu_seconds: float) -> float:
    return gpu_seconds / 3600.0
