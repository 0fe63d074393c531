"""A shared lease over its memory share: the pass's response, step by step.

The rule of when a lease is over its share is :func:`jupyter_gpusched.core.ladder.over_share`; a
pass (``_Pass.over_share`` in ``scheduler.py``) calls :func:`respond`, which answers in this order:
a notice; at a pass at least ``ladder.OVER_SHARE_RECHECK`` seconds later, if still over, the
free-cache step; if still over after that and someone is hurt (another lease shares its GPU, or a
claim waits for it), the ``reclaim_fallback`` after a ``grace_period`` notice. Back within its
share at any point: the response stops and an announced fallback is called off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from . import ladder
from .model import SHARED, Lease, LeaseState, Step, evolve
from .units import format_bytes, format_duration

if TYPE_CHECKING:
    from .scheduler import _Pass

#: How every reason about a lease over its memory share begins.
OVER_SHARE = "over its memory share"


def respond(p: _Pass, wanted: Mapping[str, str]) -> None:
    """Each shared lease over its memory share gets the next step of its response; one back
    within its share is told so, and an announced fallback is called off."""
    for lease in p.live():
        if lease.over_share_since is None and (lease.mode != SHARED or lease.memory is None):
            continue
        if lease.id in wanted:
            continue  # an idle reclaim takes the GPU back anyway
        if not lease.holding:
            if lease.over_share_since is not None:
                p.set(evolve(lease, over_share_since=None))
        elif ladder.over_share(lease):
            respond_to(p, lease)
        elif lease.over_share_since is not None:
            back_within_share(p, lease)

def gpus_of(p: _Pass, lease: Lease) -> str:
    indices = [str(p.by_uuid[u].index) if u in p.by_uuid else u for u in lease.devices]
    if len(indices) == 1:
        return f"GPU {indices[0]}"
    return f"GPUs {', '.join(indices[:-1])} and {indices[-1]}"

def harmed(p: _Pass, lease: Lease) -> str | None:
    """Who the over-share can hurt, in words (None: nobody)."""
    mine = set(lease.devices)
    live = p.live()
    if any(o.id != lease.id and o.holding and not mine.isdisjoint(o.devices) for o in live):
        return "another lease shares its GPU"
    if any(o.state == LeaseState.PENDING and not mine.isdisjoint(p.usable(o)) for o in live):
        return "a claim waits for its GPU"
    return None

def respond_to(p: _Pass, lease: Lease) -> None:
    now, cfg = p.now, p.cfg
    per_gpu = " per GPU" if len(lease.devices) > 1 else ""
    gpus = gpus_of(p, lease)
    head = (
        f"{OVER_SHARE}: its processes hold more than the {format_bytes(lease.memory or 0)}{per_gpu} "
        f"it claimed on {gpus}"
    )
    since = lease.over_share_since
    if since is None:
        reason = f"{head}; its framework caches are dropped if it stays over"
        p.set(evolve(lease, over_share_since=now, reason=reason), "over_share", reason)
        p.wake(now + ladder.OVER_SHARE_RECHECK)
        return
    step = lease.reclaim_step
    if lease.state == LeaseState.RECLAIMING:
        if step is None or not step.disruptive:
            return  # a step under way (free-cache, or an idle reclaim's checkpoint) finishes first
        if harmed(p, lease) is None:
            reason = f"{head}; the {step} is off: nobody else uses {gpus} or waits for it any more"
            p.set(
                evolve(lease, state=LeaseState.ACTIVE, reclaim_at=None, reclaim_step=None, reason=reason),
                "cancel",
                reason,
            )
        elif lease.reclaim_at is None or lease.reclaim_at <= now:
            p.set(lease, "reclaim", lease.reason)
        else:
            p.wake(lease.reclaim_at)
        return
    if Step.FREE_CACHE not in lease.tried_steps:
        if now < since + ladder.OVER_SHARE_RECHECK:
            reason = f"{head}; its framework caches are dropped if it stays over"
            if reason != lease.reason:
                p.set(evolve(lease, reason=reason))
            p.wake(since + ladder.OVER_SHARE_RECHECK)
            return
        reason = f"{head}; dropping its framework caches"
        p.set(
            evolve(lease, state=LeaseState.RECLAIMING, reclaim_at=now, reclaim_step=Step.FREE_CACHE, reason=reason),
            "reclaim",
            reason,
        )
        return
    harm = harmed(p, lease)
    after = f"{head}; dropping its framework caches did not bring it within its share"
    fallback = cfg.reclaim_fallback
    verb = "restarted" if fallback == "restart" else "shut down"
    grace = format_duration(cfg.grace_period)
    if fallback == "none":
        reason = f"{after}; reclaim_fallback is 'none', so the kernel keeps running"
        if harm is not None:
            reason += f" although {harm}"
    elif harm is None:
        reason = (
            f"{after}; nobody else uses {gpus} or waits for it, so the kernel keeps running "
            f"(it will be {verb} after a {grace} notice if someone does)"
        )
    else:
        at = now + cfg.grace_period
        reason = f"{after} and {harm}, so the kernel will be {verb} after a {grace} notice unless it frees GPU memory"
        step = Step.RESTART if fallback == "restart" else Step.SHUTDOWN
        p.set(
            evolve(lease, state=LeaseState.RECLAIMING, reclaim_at=at, reclaim_step=step, reason=reason),
            "notice" if at > now else "reclaim",
            reason,
        )
        p.wake(at)
        return
    if reason != lease.reason:
        # Told once per change: a pass that only marked the lease idle or active again
        # (which rewrites the reason) does not tell it again.
        told = p.input[lease.id].reason == reason
        p.set(evolve(lease, reason=reason), None if told else "over_share", reason)

def back_within_share(p: _Pass, lease: Lease) -> None:
    step = lease.reclaim_step
    if lease.state == LeaseState.RECLAIMING and step is not None and step.disruptive:
        reason = f"back within its memory share: the {step} is off"
        p.set(
            evolve(
                lease, state=LeaseState.ACTIVE, reclaim_at=None, reclaim_step=None, over_share_since=None,
                reason=reason,
            ),
            "cancel",
            reason,
        )
    elif lease.state == LeaseState.RECLAIMING:
        p.set(evolve(lease, over_share_since=None))  # a step under way finishes
    else:
        p.set(evolve(lease, over_share_since=None, reason="back within its memory share"))
