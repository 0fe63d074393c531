"""Quotas and the fair queue across users.

A user's quota is the number of GPUs guaranteed to them: ``quotas["user:NAME"]``, else the
largest ``quotas["group:NAME"]`` of their groups, else ``quotas["*"]``, else a fair share of the
host (healthy GPUs divided by the users who hold or want GPUs). Leases a user holds beyond the
quota are *borrowed*; the oldest leases are the guaranteed ones.

The queue orders pending claims by: claims that stay within the user's quota (or have waited a long
time) first, then the user's usage relative to their quota, then priority, then age.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Callable, Iterable, Mapping, Sequence

from .model import HOLDING, Device, Lease, SchedConfig
from .placement import schedulable

#: A claim that waited this many times ``backfill_wait`` is served like a claim within quota.
AGING_FACTOR = 5


def quota_of(user: str, groups: Iterable[str], quotas: Mapping[str, float], fair_share: float) -> float:
    """GPUs guaranteed to ``user`` (see module docstring)."""
    if f"user:{user}" in quotas:
        return float(quotas[f"user:{user}"])
    group_quotas = [float(quotas[f"group:{g}"]) for g in groups if f"group:{g}" in quotas]
    if group_quotas:
        return max(group_quotas)
    if "*" in quotas:
        return float(quotas["*"])
    return fair_share


def fair_share(devices: Sequence[Device], leases: Iterable[Lease]) -> float:
    users = {lease.user for lease in leases if lease.live}
    return len(schedulable(devices)) / max(1, len(users))


class Usage:
    """GPUs held per user, kept current while a pass grants claims."""

    def __init__(self, leases: Iterable[Lease], quotas: Mapping[str, float], share: float) -> None:
        self.held: dict[str, int] = defaultdict(int)
        self.groups: dict[str, tuple[str, ...]] = {}
        self._quotas = quotas
        self._share = share
        groups, held = self.groups, self.held
        for lease in leases:
            if lease.user not in groups:
                groups[lease.user] = lease.groups
            if lease.state in HOLDING:
                held[lease.user] += lease.count

    def quota(self, user: str) -> float:
        return quota_of(user, self.groups.get(user, ()), self._quotas, self._share)

    def within_quota(self, lease: Lease) -> bool:
        return self.held[lease.user] + lease.count <= self.quota(lease.user) + 1e-9

    def ratio(self, user: str) -> float:
        quota = self.quota(user)
        held = self.held[user]
        if quota <= 0:
            return float("inf") if held else 0.0
        return held / quota

    def add(self, lease: Lease) -> None:
        self.held[lease.user] += lease.count


def queue_key(lease: Lease, usage: Usage, now: float, cfg: SchedConfig) -> tuple:
    """Sort key of a pending claim: smaller is served first."""
    if cfg.policy == "static":
        return (lease.queued_at, lease.created_at, lease.id)
    aged = now - lease.queued_at >= cfg.backfill_wait * AGING_FACTOR
    first_class = aged or usage.within_quota(lease) or cfg.policy == "dynamic"
    return (
        0 if first_class else 1,
        usage.ratio(lease.user),
        -lease.priority,
        lease.queued_at,
        lease.created_at,
        lease.id,
    )


def fair_order(
    pending: Sequence[Lease],
    usage: Usage,
    now: float,
    cfg: SchedConfig,
    serve: Callable[[Lease], bool] | None = None,
) -> list[Lease]:
    """Pending claims in the order they would be served if each were granted in turn.

    Each user's own claims go by :func:`queue_key` too: those that keep the user within quota
    first (a claim that would borrow must not hold back the same user's claim that the quota
    guarantees), then priority, then age. Across users the head claims compete by
    :func:`queue_key`, recomputed for a user after each of their claims is counted as granted.
    With ``serve``, each claim is offered to it in that order, and counts against its user only
    if ``serve`` returns True (it was granted): a claim that does not fit must not make the same
    user's next claim look like borrowing.
    """
    if cfg.policy == "static":
        ordered = sorted(pending, key=lambda lease: queue_key(lease, usage, now, cfg))
        if serve is not None:
            for lease in ordered:
                serve(lease)
        return ordered
    shadow = Usage((), usage._quotas, usage._share)
    shadow.held = defaultdict(int, usage.held)
    shadow.groups = dict(usage.groups)
    per_user: dict[str, list[Lease]] = defaultdict(list)
    for lease in pending:
        per_user[lease.user].append(lease)
    # A user's claims differ in queue_key only by whether each is first class and by the key's
    # tail (priority, age, id): in tail order, the user's head is the first first-class claim,
    # or the first claim where none is. Found by a scan that mostly stops at the first claim, not
    # by the key of every claim each time one is served.
    for claims in per_user.values():
        claims.sort(key=lambda le: (-le.priority, le.queued_at, le.created_at, le.id))
    aging = cfg.backfill_wait * AGING_FACTOR
    dynamic = cfg.policy == "dynamic"

    def head_index(user: str) -> int:
        claims = per_user[user]
        if dynamic:
            return 0
        for i, lease in enumerate(claims):
            if now - lease.queued_at >= aging or shadow.within_quota(lease):
                return i
        return 0

    def head(user: str) -> Lease:
        return per_user[user][head_index(user)]

    heap = [(queue_key(head(user), shadow, now, cfg), user) for user in per_user]
    heapq.heapify(heap)
    ordered: list[Lease] = []
    while heap:
        _, user = heapq.heappop(heap)
        lease = per_user[user].pop(head_index(user))
        ordered.append(lease)
        if serve is None or serve(lease):
            shadow.add(lease)
        if per_user[user]:
            heapq.heappush(heap, (queue_key(head(user), shadow, now, cfg), user))
    return ordered


def borrowed(leases: Iterable[Lease], usage: Usage) -> set[str]:
    """Ids of holding leases beyond their user's quota (the newest ones are the borrowed ones)."""
    by_user: dict[str, list[Lease]] = defaultdict(list)
    for lease in leases:
        if lease.holding:
            by_user[lease.user].append(lease)
    out: set[str] = set()
    for user, held in by_user.items():
        quota = usage.quota(user)
        total = 0
        for lease in sorted(held, key=lambda le: (le.granted_at or 0.0, le.id)):
            total += lease.count
            if total > quota + 1e-9:
                out.add(lease.id)
    return out
