"""Which idle leases a pass takes back so that the waiting claims fit, and why.

``victims_for`` is the pass's choice (``_Pass.victims_for`` in ``scheduler.py`` calls it): idle
leases past their threshold (in hybrid, a lease within its user's quota yields only to that same
user's claims), borrowed ones of the heaviest recent user first; steps that keep every kernel's
state before any restart or shutdown; never more than a claim needs; and a kernel its host says
runs a cell only where no idle kernel can serve the claim, now or soon (``idle_instead``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from . import fairness, ladder
from .model import Lease, LeaseState, Step, evolve
from .placement import occupy, vacate
from .units import format_gpu_time

if TYPE_CHECKING:
    from .scheduler import _Limits, _Pass


def victims_for(
    p: _Pass, blocked: list[Lease], usage: fairness.Usage, limits: _Limits
) -> dict[str, str]:
    """Idle leases to take back so that waiting claims fit, with the reason for each."""
    if p.cfg.policy == "static" or not blocked:
        return {}
    borrowed = fairness.borrowed(p.live(), usage)
    # Idle leases past the contended threshold. In hybrid a lease within its user's quota
    # yields only to that same user's waiting kernels (the quota protects a user from
    # others, not one of their notebooks from another).
    eligible: list[tuple[float, Lease, bool]] = []
    # Idle leases not yet past their threshold (when they will be, the lease, anyone): a
    # kernel said to run a cell is not taken while one of these will serve the claim soon.
    upcoming: list[tuple[float, Lease, bool]] = []
    running = p.running
    waiting_users = {claim.user for claim in blocked}
    for lease in p.live():
        if not lease.holding or lease.busy or p.pinned(lease):
            continue
        idle_for = lease.idle_seconds(p.now)
        anyone = True
        if p.cfg.policy == "dynamic":
            threshold = limits.of(lease).idle_after
        elif lease.id in borrowed:
            threshold = min(limits.of(lease).idle_after, p.cfg.contended_idle_timeout)
        elif lease.user in waiting_users:
            threshold = min(limits.of(lease).idle_after, p.cfg.contended_idle_timeout)
            anyone = False
        else:
            continue  # within quota and nobody of its user waits: only the uncontended rules
        if idle_for >= threshold:
            eligible.append((idle_for, lease, anyone))
        elif lease.last_active_at is not None:
            p.wake(lease.last_active_at + threshold)
            if lease.kernel_id not in running:
                upcoming.append((lease.last_active_at + threshold, lease, anyone))
    # A kernel whose host says it runs a cell is not taken before an otherwise equal idle one:
    # that word alone cannot keep a GPU (the host counts it only with evidence, and not for
    # ever), but between two candidates of the same standing it decides. It does not lift a
    # lease above the fair order: a borrowed lease of the heaviest user still goes first.
    if p.recent:
        # Borrowed leases first, of the user with the most recent usage per guaranteed GPU
        # first; then, as without usage, the longest idle first.
        def standing(lease: Lease) -> tuple:
            return (-(usage.used_ratio(lease.user) if lease.id in borrowed else -1.0),)
    else:
        def standing(lease: Lease) -> tuple:
            return ()

    eligible.sort(key=lambda item: (*standing(item[1]), item[1].kernel_id in running, -item[0], item[1].id))
    chosen: dict[str, str] = {}
    # The host as it will be once the chosen victims are gone and the claims before this one
    # hold their devices: two waiting claims must not count on the same freed GPU, and a claim
    # that fits already (held back only by a reservation) needs no victim at all.
    holding = {le.id: le for le in p.live() if le.holding}
    # Occupancy of the planned host, kept current as victims are chosen and claims placed.
    planned = p.occupancy(holding.values())

    def fit(claim: Lease, gone: Iterable[str]):
        trial = dict(planned)
        for vid in gone:
            vacate(trial, holding[vid], p.by_uuid)
        return p.placement_for(claim, (), occ=trial)

    # A step that keeps the kernel's state (a release of a lease holding no memory, a
    # checkpoint within the host budget) is taken before any restart or shutdown that would
    # serve the same claim: the victims are first sought among the gentle ones alone. The
    # budget a gentle checkpoint takes is counted here so two of them cannot count on it.
    gentle_room = [p.checkpoint_room()]

    def gentle_step(lease: Lease, room: int | None) -> tuple[Step | None, int | None]:
        """The step that keeps ``lease``'s state, and the budget left after it (None: none does)."""
        if lease.state == LeaseState.RECLAIMING and lease.reclaim_step is not None and not lease.reclaim_step.disruptive:
            return lease.reclaim_step, room  # under way: its checkpoint is already in the budget
        step, _ = ladder.choose_step(lease, p.cfg, p.caps, room)
        if step is None or step.disruptive:
            return None, room
        if step == Step.CHECKPOINT and room is not None:
            room -= lease.memory_held or 0
        return step, room

    def pick(claim: Lease, only_gentle: bool):
        picked: list[str] = []
        room = gentle_room[0]
        for _, victim, anyone in eligible:
            if victim.id in chosen or (not anyone and victim.user != claim.user):
                continue
            if only_gentle:
                step, room = gentle_step(victim, room)
                if step is None:
                    continue
            picked.append(victim.id)
            placed = fit(claim, picked)
            if placed is not None:
                if only_gentle:
                    gentle_room[0] = room
                return picked, placed
        return picked, None

    for claim in blocked:
        if not p.could_fit(claim):
            continue
        picked: list[str] = []
        placed = fit(claim, ())
        if placed is None:
            gently = False
            if any(gentle_step(victim, gentle_room[0])[0] is not None for _, victim, _ in eligible):
                picked, placed = pick(claim, only_gentle=True)
                gently = placed is not None
            if placed is None:
                picked, placed = pick(claim, only_gentle=False)
            if placed is None:
                continue
            # Picking by idle time can take leases that free nothing this claim can use (a
            # shared GPU that a busy lease still holds): drop those, least idle first.
            for vid in reversed(picked[:-1]):
                trial = [v for v in picked if v != vid]
                found = fit(claim, trial)
                if found is not None:
                    picked, placed = trial, found
            said = [holding[vid] for vid in picked if holding[vid].kernel_id in running]
            if said:
                bar = max(standing(lease) for lease in said)
                soon = idle_instead(p, 
                    claim, chosen, [e for e in eligible if standing(e[1]) <= bar],
                    [u for u in upcoming if standing(u[1]) <= bar], fit,
                )
                if soon is not None:
                    p.wake(soon)
                    continue  # the idle kernel's GPU is taken once its time is up
            for vid in picked:
                above = p.cfg.policy == "hybrid" and vid in borrowed
                share = " beyond its user's guaranteed share" if above else ""
                why = f"idle{share} while {claim.user} waits for a GPU"
                if p.recent and vid in borrowed:
                    owner = holding[vid].user
                    why += f" ({owner} used {format_gpu_time(usage.used(owner))} recently)"
                if holding[vid].kernel_id in running:
                    why += (
                        "; its server says it runs a cell, but no use of CPU or GPU backs that, "
                        "and no idle kernel can serve the claim"
                    )
                chosen[vid] = why
                if gently:
                    p.gentle_victims.add(vid)
                vacate(planned, holding[vid], p.by_uuid)
            if gently:
                p.gently_served.add(claim.id)
        occupy(planned, evolve(claim, state=LeaseState.ACTIVE, devices=placed[0]), p.by_uuid)
    return chosen

def idle_instead(p: _Pass, claim: Lease, chosen, eligible, upcoming, fit) -> float | None:
    """When the idle leases (not said to run a cell) that ``claim`` may take will, between them,
    make room for it: now, or once the last of those needed is past its threshold. None: they
    never will, and a kernel said to run a cell is taken."""

    def allowed(lease: Lease, anyone: bool) -> bool:
        return lease.id not in chosen and (anyone or lease.user == claim.user) and lease.kernel_id not in p.running

    now_ids = [le.id for _, le, anyone in eligible if allowed(le, anyone)]
    later = sorted((at, le.id) for at, le, anyone in upcoming if allowed(le, anyone))
    ids = list(now_ids)
    for at, lease_id in later:
        ids.append(lease_id)
        if fit(claim, ids) is not None:
            return at
    return None
