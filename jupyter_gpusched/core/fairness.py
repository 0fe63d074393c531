"""Quotas and the fair queue across users.

A user's quota is the number of GPUs guaranteed to them: ``quotas["user:NAME"]``, else the
largest ``quotas["group:NAME"]`` of their groups, else ``quotas["*"]``, else a fair share of the
host (healthy GPUs divided by the users who hold or want GPUs). Leases a user holds beyond the
quota are *borrowed*; the oldest leases are the guaranteed ones.

The queue orders pending claims by: claims that stay within the user's quota (or have waited a long
time) first, then the GPUs the user holds relative to their quota, then the user's recent usage
(GPU-seconds decayed with ``usage_half_life``, :mod:`.usage`) relative to their quota, then the
recent usage of the user's busiest group relative to that group's quota, then priority, then age.
With ``usage_half_life`` 0 no usage is known and the order is that of quota, priority and age.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Callable, Iterable, Mapping, Sequence

from .model import HOLDING, Device, Lease, SchedConfig
from .placement import schedulable
from .units import format_duration, format_gpu_time

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
    """GPUs held per user, kept current while a pass grants claims, and each subject's recent
    usage (``recent``: ``"user:NAME"`` / ``"group:NAME"`` -> decayed GPU-seconds), which a pass
    does not change."""

    def __init__(
        self,
        leases: Iterable[Lease],
        quotas: Mapping[str, float],
        share: float,
        recent: Mapping[str, float] | None = None,
    ) -> None:
        self.held: dict[str, int] = defaultdict(int)
        self.groups: dict[str, tuple[str, ...]] = {}
        self._quotas = quotas
        self._share = share
        self.recent: Mapping[str, float] = recent or {}
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

    def used(self, user: str) -> float:
        """The user's recent usage in GPU-seconds (0 when not tracked)."""
        return self.recent.get(f"user:{user}", 0.0)

    def used_ratio(self, user: str) -> float:
        """Recent usage per guaranteed GPU: a user with a larger quota may use more."""
        if not self.recent:
            return 0.0
        return _per(self.used(user), self.quota(user))

    def group_ratio(self, user: str) -> float:
        """Recent usage of the user's busiest group per GPU of that group's quota (the user's own
        quota where the group has none)."""
        if not self.recent:
            return 0.0
        worst = 0.0
        for group in self.groups.get(user, ()):
            used = self.recent.get(f"group:{group}")
            if used:
                quota = self._quotas.get(f"group:{group}")
                worst = max(worst, _per(used, float(quota) if quota is not None else self.quota(user)))
        return worst


#: The quota recent usage is divided by for a user guaranteed nothing: such usage weighs far more
#: than anyone's with a guarantee, and still orders those users among themselves.
NO_QUOTA = 1e-6


def _per(used: float, quota: float) -> float:
    return used / max(quota, NO_QUOTA)


def queue_key(lease: Lease, usage: Usage, now: float, cfg: SchedConfig) -> tuple:
    """Sort key of a pending claim: smaller is served first.

    The key's parts, in order (see :data:`FACTORS`): first class (within quota, aged, or
    ``dynamic``), GPUs held per quota, recent usage per quota, the busiest group's recent usage
    per quota, priority, then age and id.
    """
    if cfg.policy == "static":
        return (lease.queued_at, lease.created_at, lease.id)
    aged = now - lease.queued_at >= cfg.backfill_wait * AGING_FACTOR
    first_class = aged or usage.within_quota(lease) or cfg.policy == "dynamic"
    user = lease.user
    return (
        0 if first_class else 1,
        usage.ratio(user),
        usage.used_ratio(user),
        usage.group_ratio(user),
        -lease.priority,
        lease.queued_at,
        lease.created_at,
        lease.id,
    )


#: Why a claim is ahead of another, by the first part of :func:`queue_key` in which they differ.
FACTORS = (
    "within their quota",
    "holding less of their quota now",
    "who used less of their quota recently",
    "whose group used less of its quota recently",
    "with a higher priority",
    "waiting longer",
    "waiting longer",
    "waiting longer",
)


def fair_order(
    pending: Sequence[Lease],
    usage: Usage,
    now: float,
    cfg: SchedConfig,
    serve: Callable[[Lease], bool] | None = None,
    keys: dict[str, tuple] | None = None,
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
        if keys is not None:
            for lease in ordered:
                keys[lease.id] = queue_key(lease, usage, now, cfg)
        if serve is not None:
            for lease in ordered:
                serve(lease)
        return ordered
    shadow = Usage((), usage._quotas, usage._share, usage.recent)
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
        key, user = heapq.heappop(heap)
        lease = per_user[user].pop(head_index(user))
        ordered.append(lease)
        if keys is not None:
            keys[lease.id] = key
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


def half_life_text(seconds: float) -> str:
    """``usage_half_life`` for people: ``1 day``, ``3 days``, else a duration (``12h00m``)."""
    days = seconds / 86400.0
    if days >= 1 and days == int(days):
        return f"{int(days)} day{'s' if days > 1 else ''}"
    return format_duration(seconds)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def explain(
    queue: Sequence[Lease],
    keys: Mapping[str, tuple],
    recent: Mapping[str, float],
    now: float,
    cfg: SchedConfig,
    users: int | None = None,
) -> dict[str, str]:
    """Why each waiting claim stands where it does in ``queue`` (the fair order of a pass at
    ``now``; ``keys`` the keys it came out with, ``recent`` the usage it was ordered by;
    ``users`` how many users hold or want GPUs, where known: with one alone, nobody lends and
    nobody borrows, and a claim beyond the quota waits for that user's own kernels).

    Says the claim's place, its class (within quota, beyond it, or served as within quota after a
    long wait), its user's recent usage where it is tracked, and for the claims ahead of it the
    first part of the order in which each beat it, e.g. ``"3rd in line: within quota; alice used
    41.2 GPU-hours recently (half-life 1 day); ahead of it: 2 claims of users who used less of their
    quota recently"``.
    """
    out: dict[str, str] = {}
    static = cfg.policy == "static"
    tracked = cfg.usage_half_life > 0 and not static
    aging = cfg.backfill_wait * AGING_FACTOR
    for i, lease in enumerate(queue):
        key = keys.get(lease.id)
        if key is None:
            continue
        if static:
            standing = "first come, first served (static policy)"
        elif cfg.policy == "dynamic":
            standing = "no guaranteed shares (dynamic policy)"
        elif key[0] == 1 and users == 1:
            standing = f"every GPU is held by other kernels of {lease.user}, the only user here; it gets the first they give back"
        elif key[0] == 1:
            standing = "beyond its user's quota (it would borrow a GPU)"
        elif now - lease.queued_at >= aging:
            standing = f"waited over {format_duration(aging)}, so served as within quota"
        else:
            standing = "within quota"
        parts = [f"{_ordinal(i + 1)} in line: {standing}"]
        if tracked:
            used = format_gpu_time(recent.get(f"user:{lease.user}", 0.0))
            parts.append(f"{lease.user} used {used} recently (half-life {half_life_text(cfg.usage_half_life)})")
        reasons: dict[str, int] = {}
        own = 0
        for other in queue[:i]:
            if other.user == lease.user:
                own += 1
                continue
            theirs = keys.get(other.id)
            if theirs is None:
                continue
            factor = next((j for j, (a, b) in enumerate(zip(theirs, key)) if a != b), None)
            if static or factor is None:
                why = "waiting longer"
            elif theirs[factor] > key[factor]:
                why = "whose turn came first"
            else:
                why = FACTORS[factor]
            reasons[why] = reasons.get(why, 0) + 1
        ahead = [
            f"1 claim of a user {why}" if n == 1 else f"{n} claims of users {why}" for why, n in reasons.items()
        ]
        if own:
            ahead.append(f"{own} earlier claim{'s' if own > 1 else ''} of {lease.user}")
        if ahead:
            parts.append("ahead of it: " + ", ".join(ahead))
        out[lease.id] = "; ".join(parts)
    return out
