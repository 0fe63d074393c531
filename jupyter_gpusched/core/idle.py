"""Idle detection and adaptive idle timeouts.

A kernel is active while it executes a cell or its own processes use the GPU above
``idle_utilization_threshold``; every idle clock runs from the last such moment. Each time a kernel
comes back after an idle spell, the spell's length is remembered on its lease (``Lease.gaps``).

The adaptive timeouts read those spells (padded with other kernels' recent spells while a kernel
has few of its own) as a survival curve. At a candidate time ``t`` the question is: of the spells
that lasted longer than ``t``, how many lasted a further ``idle_timeout``? If most did, a kernel
idle for ``t`` is probably gone for a while and its GPU is better used elsewhere. So a kernel whose
pauses are long is reclaimed sooner than ``idle_timeout``, and one that reliably returns a little
after ``idle_timeout`` keeps its GPU until after it usually returns.

Two rules keep this from taking a GPU back early on thin evidence. A pause past ``t`` is judged
long only if the kernel itself has once paused past ``t`` for a further ``idle_timeout``: a kernel
whose own pauses are short is never judged by other kernels' habits, and "never paused this long"
is no evidence that this pause will be long. And the host's spells that pad a kernel's history are
other kernels' spells: a kernel's own spells are never counted twice.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Sequence

from .model import KernelActivity, Lease, SchedConfig, Step, evolve
from .units import format_duration

#: Idle spells shorter than this are noise between two cells, not a pause.
MIN_GAP = 1.0
#: Idle spells remembered per kernel.
HISTORY = 32
#: Spells a kernel needs of its own before the host's spells stop padding its history.
OWN_SAMPLES = 6
#: Spells needed in all before timeouts adapt at all.
MIN_SAMPLES = 8
#: Spells that must have lasted past ``t`` before a pause past ``t`` can be judged at all.
MIN_BEYOND = 2
#: Share of long remainders at which a pause is judged to be a long one.
P_LONG = 0.6
#: The earliest an idle lease can count idle, as a fraction of ``idle_timeout``.
FLOOR = 0.25
#: Step between candidate times.
GROWTH = 1.25
#: Recent spells per kernel that go into the host's history.
PRIOR_PER_KERNEL = 8
#: Spells in the host's history.
PRIOR_LIMIT = 256


@dataclass(frozen=True)
class Timeouts:
    """When a lease counts idle and when it may be reclaimed without disrupting anyone.

    ``reason`` says in plain words why they are what they are: what in the kernel's history moved
    them, or why they stayed at ``idle_timeout`` and ``release_timeout`` (a clause without
    parentheses, to go inside a longer sentence).
    """

    idle_after: float
    keep_after: float | None
    reason: str


@dataclass(frozen=True)
class HostPrior:
    """Recent idle spells of the kernels on a host, by lease, to pad short histories.

    ``spells`` is every spell in the window; :meth:`excluding` is the same window without one
    lease's own spells, which that lease already counts as its own.
    """

    segments: tuple[tuple[str, tuple[float, ...]], ...] = ()
    limit: int = PRIOR_LIMIT

    @property
    def spells(self) -> tuple[float, ...]:
        return self.excluding(None)

    def excluding(self, lease_id: str | None) -> tuple[float, ...]:
        """The most recent ``limit`` spells of every lease but ``lease_id``."""
        if self.limit <= 0:
            return ()
        flat, spans = self._index
        span = spans.get(lease_id)  # type: ignore[arg-type]
        if span is None:
            return flat[-self.limit :]
        if span[0] < 0:
            return self._excluding_slowly(lease_id)
        # The last ``limit`` spells with the lease's own segment cut out, by slicing: a pass asks
        # this of every lease, so walking every segment each time would cost leases squared.
        start, stop = span
        after = len(flat) - stop
        if after >= self.limit:
            return flat[-self.limit :]
        return flat[max(0, start - (self.limit - after)) : start] + flat[stop:]

    def count_excluding(self, lease_id: str | None) -> int:
        """``len(self.excluding(lease_id))``, without building it."""
        if self.limit <= 0:
            return 0
        total, sizes = self._sizes
        own = sizes.get(lease_id)  # type: ignore[arg-type]
        if own is None:
            return min(self.limit, total)
        if own < 0:
            return len(self._excluding_slowly(lease_id))
        return min(self.limit, total - own)

    @cached_property
    def _sizes(self) -> tuple[int, dict[str, int]]:
        """Spells in all, and each lease's own (-1: in several segments)."""
        total = 0
        sizes: dict[str, int] = {}
        for owner, spells in self.segments:
            sizes[owner] = -1 if owner in sizes else len(spells)
            total += len(spells)
        return total, sizes

    @cached_property
    def _index(self) -> tuple[tuple[float, ...], dict[str, tuple[int, int]]]:
        """Every spell in order, and where each lease's segment lies in it ((-1, -1): in several)."""
        flat: list[float] = []
        spans: dict[str, tuple[int, int]] = {}
        for owner, spells in self.segments:
            spans[owner] = (-1, -1) if owner in spans else (len(flat), len(flat) + len(spells))
            flat.extend(spells)
        return tuple(flat), spans

    def _excluding_slowly(self, lease_id: str | None) -> tuple[float, ...]:
        out: list[tuple[float, ...]] = []
        room = self.limit
        for owner, spells in reversed(self.segments):
            if owner == lease_id:
                continue
            if len(spells) >= room:
                out.append(spells[len(spells) - room :])
                break
            out.append(spells)
            room -= len(spells)
        return tuple(s for seg in reversed(out) for s in seg)

    def __len__(self) -> int:
        return len(self.spells)

    def __iter__(self):
        return iter(self.spells)


def observe(lease: Lease, activity: KernelActivity | None, now: float, cfg: SchedConfig) -> Lease:
    """Fold one tick's observation of the kernel into its lease.

    While the kernel stays active the record does not change (no write per tick); the idle clock
    starts when activity ends.
    """
    if activity is None:
        return lease
    utilization = activity.gpu_utilization
    active_now = activity.busy or (utilization is not None and utilization >= cfg.idle_utilization_threshold)
    busy = lease.busy
    last = lease.last_active_at
    gaps = lease.gaps
    if not busy and last is not None:
        # An idle spell ended if the kernel ran since we last looked (perhaps a short cell that
        # began and ended between two ticks).
        began = activity.started_at
        resumed_at = began if began is not None and began > last else (now if active_now else None)
        if resumed_at is not None:
            gap = resumed_at - last
            if gap >= MIN_GAP:
                gaps = (*gaps, gap)[-HISTORY:]
    if active_now:
        if not busy:
            last = now
    else:
        last_busy = activity.last_busy_at
        if last_busy is not None and (last is None or last_busy > last):
            last = min(last_busy, now)
        elif busy:
            last = now
    memory = activity.gpu_memory
    if memory is None:
        memory = lease.memory_held
    if active_now == busy and last == lease.last_active_at and gaps == lease.gaps and memory == lease.memory_held:
        return lease
    tried = lease.tried_steps
    if active_now:
        # Running code starts the ladder afresh, but a free-cache step taken for an over-share
        # counts until the lease is back within its share (else a busy kernel is asked forever).
        over = lease.over_share_since is not None and Step.FREE_CACHE in tried
        tried = (Step.FREE_CACHE,) if over else ()
    return evolve(lease, busy=active_now, last_active_at=last, gaps=gaps, memory_held=memory, tried_steps=tried)


def record_gap(lease: Lease, now: float) -> tuple[float, ...]:
    """The lease's idle spells with the one that ends ``now`` added."""
    if lease.busy or lease.last_active_at is None:
        return lease.gaps
    gap = now - lease.last_active_at
    if gap < MIN_GAP:
        return lease.gaps
    return (*lease.gaps, gap)[-HISTORY:]


def _samples(lease: Lease, prior: Sequence[float] | HostPrior) -> list[float]:
    own = list(lease.gaps)
    if len(own) >= OWN_SAMPLES:
        return sorted(own)
    others = prior.excluding(lease.id) if isinstance(prior, HostPrior) else prior
    return sorted(own + list(others))


def _first_long_point(
    samples: list[float], own: list[float], start: float, stop: float, horizon: float
) -> float | None:
    """Smallest candidate ``t`` in [start, stop] at which a pause past ``t`` is probably long.

    ``samples`` (sorted) is the history the share is read from, ``own`` (sorted) the kernel's own
    spells. Nothing is long where the kernel has never itself paused past ``t + horizon``, or
    where too few spells lasted past ``t`` to judge.
    """
    n = len(samples)
    longest_own = own[-1] if own else 0.0
    t = start
    while t <= stop + 1e-9:
        beyond_t = n - bisect.bisect_right(samples, t)
        if beyond_t < MIN_BEYOND or t + horizon >= longest_own:
            return None  # no later candidate has more evidence
        beyond_horizon = n - bisect.bisect_right(samples, t + horizon)
        if beyond_horizon / beyond_t >= P_LONG:
            return t
        t *= GROWTH
    return None


_TOO_FEW = "too few pauses yet to learn from"
_NOT_LONG = "this kernel's own pauses have not been long ones"


@lru_cache(maxsize=64)
def _plain(idle_after: float, keep_after: float | None, reason: str) -> Timeouts:
    """The timeouts as configured (one record per config, shared: a pass asks for them often)."""
    return Timeouts(idle_after, keep_after, reason)


def timeouts(lease: Lease, prior: Sequence[float] | HostPrior, cfg: SchedConfig) -> Timeouts:
    """The adaptive idle timeouts of ``lease`` (``keep_after`` None: keep while nobody waits).

    ``prior`` is :func:`host_prior` of the host's leases (the lease's own spells in it are left
    out), or a plain sequence of other kernels' spells.
    """
    base_keep = cfg.release_timeout if cfg.release_timeout > 0 else None
    if cfg.policy == "static":
        return _plain(cfg.idle_timeout, None, "the static policy holds a lease until its kernel ends")
    if not cfg.adaptive or cfg.idle_timeout <= 0:
        return _plain(cfg.idle_timeout, base_keep, "the configured timeouts")
    gaps = lease.gaps
    # _samples(lease, prior), counted before it is built: most leases never need it at all.
    own_enough = len(gaps) >= OWN_SAMPLES
    if own_enough:
        padding = 0
    elif isinstance(prior, HostPrior):
        padding = prior.count_excluding(lease.id)
    else:
        padding = len(prior)
    if len(gaps) + padding < MIN_SAMPLES:
        return _plain(cfg.idle_timeout, base_keep, _TOO_FEW)
    horizon = cfg.idle_timeout
    longest_own = max(gaps) if gaps else 0.0
    if longest_own <= horizon + min(max(horizon * FLOOR, 1.0), horizon):
        # Neither search below has a candidate the kernel ever paused a horizon past (the first
        # starts at the floor, the second at ``idle_timeout`` or earlier): the common case.
        return _plain(cfg.idle_timeout, base_keep, _NOT_LONG)
    built: list[list[float]] = []

    def first_long_point(start: float, stop: float) -> float | None:
        # _first_long_point answers None at once where there is no candidate or the kernel never
        # paused past ``start + horizon``: then the samples need not be built and sorted at all.
        if start > stop + 1e-9 or start + horizon >= longest_own:
            return None
        if not built:
            built.append(_samples(lease, prior))
            built.append(sorted(gaps))
        return _first_long_point(built[0], built[1], start, stop, horizon)

    early = first_long_point(max(cfg.idle_timeout * FLOOR, 1.0), cfg.idle_timeout / GROWTH)
    idle_after = early if early is not None else cfg.idle_timeout
    if base_keep is None:
        # release_timeout = 0: an idle lease is kept for as long as nobody waits.
        keep = None
    else:
        keep = first_long_point(idle_after, base_keep)
        if keep is None:
            keep = base_keep
    reason = _NOT_LONG
    if keep is not None and keep < base_keep:
        reason = f"once this kernel pauses for {format_duration(keep)} it usually stays away a while"
    if early is not None:
        reason = f"once this kernel pauses for {format_duration(idle_after)} it usually stays away a while"
    return Timeouts(idle_after, keep, reason)


def host_prior(leases: Sequence[Lease], limit: int = PRIOR_LIMIT) -> HostPrior:
    """Recent idle spells of all kernels, to pad the history of kernels that have few.

    :func:`timeouts` leaves a lease's own spells out of it.
    """
    segments = tuple((lease.id, lease.gaps[-PRIOR_PER_KERNEL:]) for lease in leases if lease.gaps)
    return HostPrior(segments, limit)
