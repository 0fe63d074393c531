"""Saying ahead what idle will do: when a held lease would be taken back, and by which step.

The forecast reads the same rules a scheduling pass applies (the adaptive timeouts of
:mod:`.idle`, the reclaim ladder of :mod:`.ladder`, the policy, quotas and ``keep_until``) for
two futures: the kernel stays idle and nobody waits (``at``), and the kernel stays idle while
someone waits for a GPU that this lease's devices could serve (``contended_at``). Both are
moments at which the step is carried out: for a disruptive step (restart, shutdown) that is
after the ``grace_period`` notice.

Pure: no I/O, no clock; ``now`` is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from . import fairness, idle, ladder
from .model import Capabilities, Device, Lease, LeaseState, SchedConfig, Step
from .placement import schedulable
from .units import format_duration

#: ``contended_by``: any waiting kernel can take the lease (borrowed capacity, or ``dynamic``).
ANYONE = "anyone"
#: ``contended_by``: only another kernel of the same user (a lease within the user's quota).
SAME_USER = "same_user"

_DONE = {
    Step.RELEASE: "released",
    Step.CHECKPOINT: "checkpointed (the next cell restores it)",
    Step.FREE_CACHE: "asked to free cached GPU memory",
    Step.RESTART: "restarted (its variables are lost)",
    Step.SHUTDOWN: "shut down (its variables are lost)",
}


@dataclass(frozen=True)
class Forecast:
    """What idle reclaim will do to one held lease if its kernel stays idle from ``now``.

    ``at``: when the step is carried out if nobody waits (None: never). ``contended_at``: when,
    if a kernel that may take it waits (never later than ``at``; None: never).
    ``contended_by`` says who can make it come sooner than ``at``: :data:`ANYONE` or
    :data:`SAME_USER` (None: nobody, a waiting claim changes nothing). ``step`` is the first step the ladder would take (None: nothing may be done).
    """

    step: Step | None
    at: float | None
    contended_at: float | None
    contended_by: str | None
    reason: str


def forecast(
    lease: Lease,
    leases: Iterable[Lease],
    now: float,
    cfg: SchedConfig,
    caps: Capabilities = Capabilities(),
    devices: Sequence[Device] = (),
) -> Forecast | None:
    """The idle forecast of ``lease`` (None for a lease that holds no GPU).

    Args:
        lease: the lease to look ahead for.
        leases: every live lease of the host (``lease`` among them or not), as the last
            scheduling pass left them: the host's idle spells and the quotas read them.
        now: the present, in the scheduler's seconds.
        cfg: the scheduling settings.
        caps: what the driver can do (whether checkpoint is possible, and on which devices not).
        devices: the host's devices (the fair share of the host counts the healthy ones; a MIG
            instance among them cannot be checkpointed).
    """
    if not lease.holding:
        return None
    if cfg.policy == "static":
        return Forecast(None, None, None, None, "static policy: the GPU stays with the kernel until it ends")
    if lease.state == LeaseState.RECLAIMING and lease.reclaim_step is not None:
        at = lease.reclaim_at if lease.reclaim_at is not None else now
        step = lease.reclaim_step
        what = "is being" if not step.disruptive else "will be"
        return Forecast(step, at, at, ANYONE, f"{what} {_DONE[step]}: {lease.reason}".rstrip(": "))

    live = [le for le in leases if le.live and le.id != lease.id]
    live.append(lease)
    limits = idle.timeouts(lease, idle.host_prior(live), cfg)
    budget = cfg.checkpoint_host_memory
    room = None if budget is None else budget - ladder.checkpoint_bytes(live)
    # MIG instances among the host's devices cannot be checkpointed: said here, ahead.
    caps = ladder.serving(caps, devices)
    step, how = ladder.choose_step(lease, cfg, caps, room)
    skipped = None
    if step is not None and step != Step.CHECKPOINT and cfg.checkpoint == "auto" and caps.checkpoint:
        skipped = ladder.checkpoint_refused(lease, caps)
        if skipped is None:
            over = ladder.over_budget(lease, room)
            skipped = f"not checkpointed: {over}" if over else None
    # The idle clock runs from the kernel's last activity; a running cell restarts it when it ends.
    since = now if lease.busy or lease.last_active_at is None else lease.last_active_at
    pinned = lease.keep_until if lease.keep_until is not None and lease.keep_until > now else None

    def when(idle_limit: float | None) -> float | None:
        if step is None or idle_limit is None:
            return None
        due = max(since + idle_limit, now)
        if pinned is not None:
            due = max(due, pinned)
        return due + (cfg.grace_period if step.disruptive else 0.0)

    gentle = step is not None and not step.disruptive
    release_after = cfg.release_timeout if cfg.release_timeout > 0 else None
    plain_limit = limits.keep_after if gentle else release_after
    at = when(plain_limit)

    if cfg.policy == "dynamic":
        by, threshold = ANYONE, limits.idle_after
    else:
        by = ANYONE if _borrowed_when_someone_waits(lease, live, cfg, devices) else SAME_USER
        threshold = min(limits.idle_after, cfg.contended_idle_timeout)
    contended_at = when(threshold)
    # Someone waiting never delays the plain reclaim.
    if contended_at is None or (at is not None and at <= contended_at):
        contended_at, sooner = at, False
    else:
        sooner = True
    return Forecast(
        step,
        at,
        contended_at,
        by if sooner else None,
        _reason(step, how, plain_limit, limits, threshold, by if sooner else None, pinned, cfg, skipped),
    )


def _borrowed_when_someone_waits(
    lease: Lease, live: Sequence[Lease], cfg: SchedConfig, devices: Sequence[Device]
) -> bool:
    """Whether ``lease`` is beyond its user's quota once a claim of another user waits.

    The waiting claim counts among the users who share the host (as the scheduler counts pending
    claims), which can turn a lease within a fair share into a borrowed one.
    """
    users = {le.user for le in live}
    stranger = "\0waiting"
    while stranger in users:
        stranger += "\0"
    waiter = Lease(id="\0waiting", kernel_id="\0waiting", user=stranger, state=LeaseState.PENDING)
    everyone = [*live, waiter]
    usage = fairness.Usage(everyone, cfg.quotas, fairness.fair_share(devices, everyone))
    return lease.id in fairness.borrowed(live, usage)


def _reason(
    step: Step | None,
    how: str,
    plain_limit: float | None,
    limits: idle.Timeouts,
    threshold: float,
    by: str | None,
    pinned: float | None,
    cfg: SchedConfig,
    skipped: str | None = None,
) -> str:
    if step is None:
        return f"never taken back while idle ({how})"
    parts = [skipped] if skipped else []
    if plain_limit is None:
        parts.append("kept while nobody waits (release_timeout is 0)")
    else:
        why = "release_timeout" if step.disruptive else limits.reason
        parts.append(f"{_DONE[step]} after {format_duration(plain_limit)} idle with nobody waiting ({why})")
    if by is not None:
        who = "someone waits for a GPU" if by == ANYONE else "another of this user's kernels waits"
        parts.append(f"after {format_duration(threshold)} idle if {who}")
        if by == SAME_USER:
            parts.append("other users' claims wait: the lease is within its user's guaranteed share")
    if step.disruptive:
        parts.append(f"announced {format_duration(cfg.grace_period)} ahead")
    if pinned is not None:
        parts.append("kept until the `%gpu keep` time runs out")
    return "; ".join(parts)


def gpu_states(
    devices: Sequence[Device],
    leases: Iterable[Lease],
    now: float,
    cfg: SchedConfig | None,
    caps: Capabilities | None = None,
) -> tuple[dict[str, str], dict[str, list[Lease]]]:
    """What each GPU of a host offers a claim of another user, as a node broker's summary says it.

    ``unavailable`` (it cannot be scheduled), ``free`` (no lease holds it), ``reclaimable`` (every
    lease on it can be taken back for another user's claim: an idle lease the idle forecast says
    someone waiting takes, or a lease already being reclaimed) or ``held``. Returns the state per
    GPU uuid and the holding leases per GPU uuid. Without ``cfg`` no idle lease counts as
    reclaimable.
    """
    live = [lease for lease in leases if lease.live]
    usable = {d.uuid for d in schedulable(devices)}
    holders: dict[str, list[Lease]] = {}
    for lease in live:
        if lease.holding:
            for uuid in lease.devices:
                holders.setdefault(uuid, []).append(lease)
    takes_back: dict[str, bool] = {}

    def reclaimable(lease: Lease) -> bool:
        if lease.id not in takes_back:
            if lease.state == LeaseState.RECLAIMING:
                takes_back[lease.id] = True
            elif lease.state != LeaseState.IDLE or cfg is None:
                takes_back[lease.id] = False
            else:
                ahead = forecast(lease, live, now, cfg, caps or Capabilities(), devices)
                takes_back[lease.id] = (
                    ahead is not None
                    and ahead.step is not None
                    and ahead.contended_at is not None
                    and ahead.contended_by != SAME_USER
                )
        return takes_back[lease.id]

    states: dict[str, str] = {}
    for device in devices:
        held = holders.get(device.uuid, [])
        if device.uuid not in usable:
            states[device.uuid] = "unavailable"
        elif not held:
            states[device.uuid] = "free"
        elif all(reclaimable(lease) for lease in held):
            states[device.uuid] = "reclaimable"
        else:
            states[device.uuid] = "held"
    return states, holders
