"""One scheduling pass: observe kernels, mark idle leases, reclaim, and grant in fair order.

:func:`plan` is a pure function of its inputs. The arbiter calls it on every reconcile tick (and
whenever a claim arrives) inside one ledger transaction, persists ``Plan.changed`` and carries out
the ``reclaim`` decisions; the simulator calls it on its virtual clock. Same inputs, same plan.
"""

from __future__ import annotations

from typing import AbstractSet, Iterable, Mapping, Sequence

from . import fairness, idle, ladder, overshare, victims
from .overshare import OVER_SHARE  # noqa: F401 - where callers found it
from .model import (
    EXCLUSIVE,
    HOLDING,
    LIVE,
    Capabilities,
    Decision,
    Device,
    KernelActivity,
    Lease,
    LeaseState,
    Plan,
    SchedConfig,
    Step,
    evolve,
)
from .placement import (
    Occupancy,
    _load_key,
    fits,
    held_per_device,
    occupy,
    outside_memory,
    place,
    restore_need,
    restore_short,
    schedulable,
    stray,
)
from .placement import RESTORE_MARGIN
from .units import format_bytes, format_duration


class _Limits:
    """Adaptive timeouts per lease, computed once per pass on first use.

    The host's spells that pad short histories are gathered on first need too: a pass in which
    no lease can turn idle (or a policy that does not adapt) never gathers them.
    """

    def __init__(self, live: Sequence[Lease], cfg: SchedConfig) -> None:
        self.live = live
        self.cfg = cfg
        self.cache: dict[str, idle.Timeouts] = {}
        self._prior: idle.HostPrior | None = None
        # idle.timeouts answers these before it reads the host's spells.
        self.fixed = cfg.policy == "static" or not cfg.adaptive or cfg.idle_timeout <= 0

    @property
    def prior(self) -> idle.HostPrior:
        if self._prior is None:
            self._prior = idle.host_prior(self.live)
        return self._prior

    def of(self, lease: Lease) -> idle.Timeouts:
        found = self.cache.get(lease.id)
        if found is None:
            found = idle.timeouts(lease, () if self.fixed else self.prior, self.cfg)
            self.cache[lease.id] = found
        return found


class _Host:
    """What a pass derives from the devices alone; a caller that passes the same tuple of devices
    pass after pass (the simulator) gets it without walking every device each time."""

    def __init__(self, devices: tuple[Device, ...]) -> None:
        self.devices = devices
        self.by_uuid = {d.uuid: d for d in devices}
        self.pool = schedulable(devices)
        self.empty_occ = {d.uuid: Occupancy(False, 0, 0) for d in devices}
        # The pool in the order placement ranks devices for an exclusive claim, and whether any
        # device is in a group (then placement must see every candidate to pick the group).
        self.pool_by_load = sorted(self.pool, key=_load_key)
        self.grouped = any(d.group is not None for d in self.pool)
        # One record per distinct occupancy of a device: most held devices are alike.
        self.occupancies: dict[tuple[bool, int, int, int, int], Occupancy] = {}
        # Devices whose processes use memory (a restore counts it against the checkpoint).
        self.used = {d.uuid: d for d in devices if d.memory_used}
        # The schedulable ones among them (where memory outside any lease can keep a claim off).
        self.used_pool = tuple(d for d in self.pool if d.memory_used)
        # Kernels that hold memory on a device outside their leases (their claims go there first).
        self.kernels_outside = frozenset(kid for d in self.pool for kid, _ in d.kernel_memory)

    def occupancy_of(
        self, exclusive: bool, promised: int, holders: int, outside: int = 0, held: int = 0
    ) -> Occupancy:
        key = (exclusive, promised, holders, outside, held)
        found = self.occupancies.get(key)
        if found is None:
            if len(self.occupancies) >= 4096:
                self.occupancies.clear()
            found = self.occupancies[key] = Occupancy(exclusive, promised, holders, outside, held)
        return found


#: Hosts derived lately, by the identity of their tuple of devices: several brokers in one
#: process (the simulator's nodes) take turns. A host holds its tuple, so no id is reused while
#: it is here.
_hosts: dict[int, _Host] = {}


def _host(devices: tuple[Device, ...]) -> _Host:
    host = _hosts.get(id(devices))
    if host is None or host.devices is not devices:
        if len(_hosts) >= 64:
            _hosts.clear()
        host = _hosts[id(devices)] = _Host(devices)
    return host


#: Reclaim steps that keep the kernel's state.
_GENTLE = frozenset(step for step in Step if not step.disruptive)
#: States whose kernels a pass does not observe: waiting for devices, or checkpointed off them.
_NOT_OBSERVED = frozenset({LeaseState.PENDING, LeaseState.SUSPENDED})


class _Pass:
    def __init__(self, devices, leases, activity, now, cfg, caps, recent=None, running=frozenset()) -> None:
        self.devices: Sequence[Device] = tuple(devices)
        host = _host(self.devices)
        self.host = host
        self.by_uuid = host.by_uuid
        self.input = {lease.id: lease for lease in leases}
        self.leases: dict[str, Lease] = dict(self.input)
        self.activity = activity
        self.now = now
        self.cfg = cfg
        self.caps = caps
        self.decisions: list[Decision] = []
        self.pool = host.pool
        # Read only: placement copies nothing into it.
        self.empty_occ = host.empty_occ
        self._could_fit: dict[tuple, bool] = {}
        self.wakeups: list[float] = []
        self._live: list[Lease] | None = None
        #: Bytes of ``checkpoint_host_memory`` not held by checkpoints (None: no limit), counted
        #: on first use and lowered by each checkpoint this pass decides.
        self._room: int | None = None
        self._room_known = cfg.checkpoint_host_memory is None
        #: Idle leases wanted back only because their step keeps the kernel's state.
        self.gentle_only: set[str] = set()
        #: Waiting claims this pass serves with steps that keep every kernel's state, and the
        #: leases it takes back for them (their steps come first out of the checkpoint budget).
        self.gently_served: set[str] = set()
        self.gentle_victims: set[str] = set()
        # Recent usage per subject (core/usage.py); none when usage_half_life is 0.
        self.recent: Mapping[str, float] = recent if recent and cfg.usage_half_life > 0 else {}
        #: The key each claim came out of the fair queue with (for fairness.explain).
        self.keys: dict[str, tuple] = {}
        #: Kernels whose host says they run a cell although the pass may not count them busy.
        self.running: AbstractSet[str] = running

    # -- helpers ---------------------------------------------------------------------------
    def set(self, lease: Lease, kind: str | None = None, reason: str = "", position: int | None = None) -> Lease:
        before = self.input.get(lease.id)
        # ``is`` first: comparing two records field by field costs more than the rest of set().
        if lease is not before and lease != before and lease.version == self.input[lease.id].version:
            lease = evolve(lease, version=lease.version + 1)
        self.leases[lease.id] = lease
        self._live = None
        if kind is not None:
            self.decisions.append(Decision(kind, lease, reason, position))
        return lease

    def checkpoint_room(self) -> int | None:
        if not self._room_known:
            self._room = self.cfg.checkpoint_host_memory - ladder.checkpoint_bytes(self.live())
            self._room_known = True
        return self._room

    def step_for(self, lease: Lease, reserve: bool = False) -> tuple[Step | None, str]:
        """The ladder's step for ``lease`` within the checkpoint budget left; with ``reserve``,
        a checkpoint chosen takes its share of the budget for the rest of the pass."""
        step, how = ladder.choose_step(lease, self.cfg, self.caps, self.checkpoint_room())
        if reserve and step == Step.CHECKPOINT and self._room is not None:
            self._room -= lease.memory_held or 0
        return step, how

    def wake(self, at: float | None) -> None:
        if at is not None and at > self.now:
            self.wakeups.append(at)

    def live(self) -> list[Lease]:
        """The live leases as they stand now (a list no caller changes), rebuilt after a set().

        Every lease of a pass is live: :func:`plan` passes only live ones and a pass never
        releases one (it grants, marks idle, reclaims and queues).
        """
        if self._live is None:
            self._live = list(self.leases.values())
        return self._live

    def occupancy(self, leases: Iterable[Lease]) -> dict[str, Occupancy]:
        """``placement.occupancy(self.devices, leases)``, from the devices nobody holds: the
        work is in the leases that hold devices, not in every device of the host."""
        occ = dict(self.empty_occ)
        counts: dict[str, list] = {}
        by_uuid = self.by_uuid
        for lease in leases:
            if lease.state not in HOLDING:
                continue
            exclusive = lease.mode == EXCLUSIVE
            # lease.promised_memory(device), inline: the whole device or the claim's memory
            memory = None if exclusive else lease.memory
            for uuid in lease.devices:
                device = by_uuid.get(uuid)
                if device is None:
                    continue
                promised = device.memory_total if memory is None else memory
                held = held_per_device(lease) if lease.memory_held else 0
                count = counts.get(uuid)
                if count is None:
                    counts[uuid] = [exclusive, promised, 1, held]
                else:
                    count[2] += 1
                    if exclusive:
                        count[0] = True
                    count[1] += promised
                    count[3] += held
        make = self.host.occupancy_of
        used = self.host.used
        for uuid, device in used.items():
            if uuid not in counts:
                occ[uuid] = make(False, 0, 0, outside_memory(device, 0))
        for uuid, (exclusive, promised, holders, held) in counts.items():
            device = used.get(uuid)
            occ[uuid] = make(exclusive, promised, holders, outside_memory(device, held) if device else 0, held)
        return occ

    def pinned(self, lease: Lease) -> bool:
        return lease.keep_until is not None and lease.keep_until > self.now

    # -- the pass --------------------------------------------------------------------------
    def run(self) -> Plan:
        self.observe()
        # The live leases as observed: the snapshot whose spells pad short histories.
        limits = _Limits(self.live(), self.cfg)
        self.mark_idle(limits)
        live = self.live()
        pending = [le for le in live if le.state == LeaseState.PENDING]
        if pending:
            # fairness.fair_share(self.devices, live), with the schedulable devices counted once per host.
            share = len(self.pool) / max(1, len({lease.user for lease in live}))
            usage = fairness.Usage(live, self.cfg.quotas, share, self.recent)
            queue, blocked = self.grant(pending, usage)
            wanted = self.victims_for(blocked, usage, limits)
        else:
            # Nothing to grant, so no claim is blocked and nothing is wanted for one.
            queue, wanted = [], {}
        wanted.update(self.uncontended(limits))
        self.reclaim(wanted)
        self.over_share(wanted)
        waiting = [le for le in queue if self.leases[le.id].state == LeaseState.PENDING]
        for position, lease in enumerate(waiting, start=1):
            current = self.leases[lease.id]
            if self.input[lease.id].state != LeaseState.PENDING or current.reason != self.input[lease.id].reason:
                self.set(current, "queue", current.reason, position)
        changed = tuple(lid for lid, le in self.leases.items() if le is not self.input[lid] and le != self.input[lid])
        return Plan(
            decisions=tuple(self.decisions),
            leases=tuple(self.leases.values()),
            changed=changed,
            queue=tuple(le.id for le in waiting),
            next_wakeup=min(self.wakeups) if self.wakeups else None,
            keys={le.id: self.keys[le.id] for le in waiting if le.id in self.keys},
            usage=self.recent,
        )

    def observe(self) -> None:
        activity, now, cfg = self.activity, self.now, self.cfg
        observe = idle.observe
        for lease in self.live():
            if lease.state in _NOT_OBSERVED:
                # A suspended kernel holds nothing on a GPU; its next cell asks to resume.
                continue
            updated = observe(lease, activity.get(lease.kernel_id), now, cfg)
            keep_until = updated.keep_until
            if keep_until is not None:
                if keep_until <= now:
                    updated = evolve(updated, keep_until=None)
                else:
                    self.wakeups.append(keep_until)
            if updated is not lease:
                self.set(updated)

    def mark_idle(self, limits: _Limits) -> None:
        for lease in self.live():
            if lease.state not in HOLDING:
                continue
            if lease.busy and lease.state != LeaseState.ACTIVE:
                if lease.state == LeaseState.RECLAIMING and not (lease.reclaim_step or Step.RELEASE).disruptive:
                    continue  # a checkpoint in progress finishes; the kernel's cell waits for the restore
                if lease.state == LeaseState.RECLAIMING and lease.over_share_since is not None:
                    continue  # over its memory share: running code does not call that off (over_share)
                kind = "cancel" if lease.state == LeaseState.RECLAIMING else "active"
                reason = "the kernel is running again" + (": reclaim cancelled" if kind == "cancel" else "")
                self.set(
                    evolve(lease, state=LeaseState.ACTIVE, reclaim_at=None, reclaim_step=None, reason=reason),
                    kind,
                    reason,
                )
            elif lease.state == LeaseState.ACTIVE and not lease.busy:
                # Only a lease that could turn idle needs its timeouts worked out.
                limit = limits.of(lease)
                if lease.idle_seconds(self.now) >= limit.idle_after:
                    reason = self.idle_reason(limit)
                    self.set(evolve(lease, state=LeaseState.IDLE, reason=reason), "idle", reason)
                elif lease.last_active_at is not None:
                    self.wake(lease.last_active_at + limit.idle_after)

    def idle_reason(self, limit: idle.Timeouts) -> str:
        # No running count ("idle for 300s"): the record is written once and must stay true for
        # as long as the kernel stays idle; idle_seconds in the lease's view is the live count.
        reason = f"idle: no cell and no GPU use for {format_duration(limit.idle_after)}"
        if limit.idle_after < self.cfg.idle_timeout and limit.reason:
            reason += f"; {limit.reason}"
        return reason

    # -- granting --------------------------------------------------------------------------
    def placement_for(
        self, lease: Lease, leases: Iterable[Lease], avoid: AbstractSet[str] = frozenset(), occ=None
    ):
        """Where ``lease`` would go now (a restore goes home, or to the same model with remap),
        keeping off the devices in ``avoid``. ``occ`` is the occupancy of ``leases`` if known."""
        if lease.home:
            # Home first: a restore onto the GPUs it came from needs no remap.
            home_only = frozenset(u for u in lease.home if u not in avoid)
            found = self._placement(lease, leases, home_only, None, occ)
            if found is not None or not self.may_remap(lease):
                return found
            models = frozenset(self.by_uuid[u].name for u in lease.home)
            return self._placement(lease, leases, None, models, occ, avoid)
        return self._placement(lease, leases, None, None, occ, avoid)

    def may_remap(self, lease: Lease) -> bool:
        """Whether a restore of ``lease`` may go onto GPUs other than its own, by the driver's
        rules: the checkpointer can remap, every GPU of the lease is known here and of one model,
        and the lease asks for as many GPUs as it had (the map must cover every one of them)."""
        if not self.caps.remap or not lease.home or lease.count != len(lease.home):
            return False
        home = [self.by_uuid.get(u) for u in lease.home]
        return all(d is not None for d in home) and len({d.name for d in home}) == 1

    def _placement(self, lease: Lease, leases, only, models, occ, avoid: AbstractSet[str] = frozenset()):
        """``placement_for`` within ``only`` (uuids) or ``models`` (device names), off ``avoid``."""
        if (
            occ is not None and lease.mode == EXCLUSIVE and not self.host.grouped
            and lease.kernel_id not in self.host.kernels_outside
        ):
            return self.exclusive_placement(lease, avoid, occ, only, models)
        if only is not None:
            allowed = [u for u in only if u not in avoid]
        else:
            allowed = [d.uuid for d in self.devices if d.uuid not in avoid] if avoid else None
        same = [d for d in self.devices if d.name in models] if models else ()
        return place(lease, self.devices, leases, same_model_as=same, only=allowed, occ=occ, pool=self.pool)

    def exclusive_placement(
        self, lease: Lease, avoid: AbstractSet[str], occ, allowed: AbstractSet[str] | None = None,
        models: AbstractSet[str] | None = None,
    ):
        """``placement_for`` an exclusive claim on a host without device groups.

        Placement ranks the devices such a claim fits on by load and takes the first ``count``;
        here the pool is walked in that order and stops at the ``count``-th device that fits and
        that the claim may use, and placement is asked to choose among those alone: the same
        choice, without testing and sorting every device of a large host.
        """
        found: list[Device] = []
        need = lease.count
        if need > 0:
            for device in self.host.pool_by_load:
                uuid = device.uuid
                if uuid in avoid or (allowed is not None and uuid not in allowed):
                    continue
                if models is not None and device.name not in models:
                    continue
                if fits(device, occ[uuid], lease):
                    found.append(device)
                    if len(found) == need:
                        break
            if len(found) < need:
                return None
        return place(lease, self.devices, (), occ=occ, pool=found)

    def usable(self, lease: Lease) -> set[str]:
        """Every device ``lease`` could be placed on when nobody holds it."""
        empty = Occupancy(False, 0, 0)
        out = {d.uuid for d in self.pool if fits(d, empty, lease)}
        if lease.home and not self.may_remap(lease):
            out &= set(lease.home)
        elif lease.home:
            models = {self.by_uuid[u].name for u in lease.home}
            out = {u for u in out if self.by_uuid[u].name in models}
        return out

    def could_fit(self, lease: Lease) -> bool:
        """Whether the claim fits on the healthy devices it may use once nobody holds them.

        For a restore that must go back to its home GPU this asks whether that GPU is healthy,
        not merely whether the host has enough GPUs.
        """
        key = (lease.count, lease.memory, lease.mode, lease.home, lease.memory_held if lease.home else None)
        known = self._could_fit.get(key)
        if known is None:
            known = self._could_fit[key] = self.placement_for(lease, (), occ=self.empty_occ) is not None
        return known

    def grant(self, pending: list[Lease], usage: fairness.Usage) -> tuple[list[Lease], list[Lease]]:
        """Grant what fits in fair order; return the fair queue and the claims left waiting."""
        blocked: list[Lease] = []
        # Devices held for claims that waited past backfill_wait: nothing behind them in the
        # queue is placed there until they are served. A restore that can only go home holds
        # its home GPU, not the whole host.
        reserved: set[str] = set()
        # What the holding leases occupy, kept current as claims are granted below.
        occ = self.occupancy(self.live())

        def serve(lease: Lease) -> bool:
            lease = self.leases[lease.id]
            chosen = self.placement_for(lease, (), avoid=reserved, occ=occ)
            if chosen is None:
                blocked.append(lease)
                possible = self.could_fit(lease)
                waited = self.now - lease.queued_at
                if possible and waited >= self.cfg.backfill_wait:
                    # Hold the line: nothing behind it takes the devices it could use.
                    reserved.update(self.usable(lease))
                elif possible:
                    self.wake(lease.queued_at + self.cfg.backfill_wait)
                why = self.why_waiting(lease, possible, self.room_short(lease, occ, reserved))
                if why != lease.reason:
                    self.set(evolve(lease, reason=why))
                return False
            devices, reason = chosen
            restored = bool(lease.home)
            verb = "restored onto" if restored else "granted"
            text = f"{verb} {reason}"
            self.set(
                evolve(
                    lease,
                    state=LeaseState.ACTIVE,
                    devices=devices,
                    granted_at=self.now,
                    last_active_at=self.now,
                    busy=False,
                    reclaim_at=None,
                    reclaim_step=None,
                    tried_steps=(),
                    reason=text,
                ),
                "grant",
                text,
            )
            occupy(occ, self.leases[lease.id], self.by_uuid)
            usage.add(lease)
            return True

        queue = fairness.fair_order(pending, usage, self.now, self.cfg, serve=serve, keys=self.keys)
        return queue, blocked

    def room_short(self, lease: Lease, occ, avoid: AbstractSet[str]) -> str | None:
        """Why a restore waits when the GPUs it may use are free by the leases' books but lack
        the real free memory for its checkpoint (None: that is not what keeps it waiting)."""
        need = restore_need(lease)
        if need is None:
            return None if lease.home else self.stray_short(lease, occ, avoid)
        short = []
        for uuid in sorted(self.usable(lease) - set(avoid)):
            device = self.by_uuid[uuid]
            free = restore_short(device, occ[uuid], lease)
            if free is not None:
                short.append((device.index, free, occ[uuid].outside))
        if not short:
            return None
        per_gpu = " per GPU" if len(lease.home) > 1 else ""
        index, free, outside = min(short, key=lambda item: (-item[1], item[0]))
        return (
            f"waiting for room to restore: GPU {index} has {format_bytes(free)} free, too little for its "
            f"{format_bytes(need - RESTORE_MARGIN)}{per_gpu} checkpoint (and a {format_bytes(RESTORE_MARGIN)} "
            f"margin): processes outside any lease use {format_bytes(outside)} there; it is restored once "
            "enough memory is free"
        )

    def stray_short(self, lease: Lease, occ, avoid: AbstractSet[str]) -> str | None:
        """Why a new claim waits when a GPU it could use is free by the leases' books but
        processes outside any lease hold memory there that the claim does not fit beside (None:
        that is not what keeps it waiting)."""
        blocked = []
        for device in self.host.used_pool:
            taken = occ[device.uuid]
            if device.uuid in avoid or not taken.outside or fits(device, taken, lease):
                continue
            if fits(device, Occupancy(taken.exclusive, taken.promised, taken.holders), lease):
                outside = stray(device, taken, lease)
                blocked.append((-outside, device.index, outside))
        if not blocked:
            return None
        _, index, outside = min(blocked)
        beside = "a claim for the whole GPU" if lease.memory is None else f"its {format_bytes(lease.memory)}"
        more = f" (and {len(blocked) - 1} other GPU(s) likewise)" if len(blocked) > 1 else ""
        return (
            f"waiting for a GPU: processes outside any lease hold {format_bytes(outside)} on GPU {index}"
            f"{more}, and {beside} does not fit beside that; it is granted once that memory is freed "
            "or another GPU is free"
        )

    def why_waiting(self, lease: Lease, possible: bool, short: str | None = None) -> str:
        remap = self.may_remap(lease)
        if not possible and lease.home and not remap:
            return "waiting: the GPU it was checkpointed from is drained or lost, and it can be restored only there"
        if not possible and lease.home:
            return "waiting: not enough healthy GPUs of the model it was checkpointed on (drained or lost)"
        if not possible:
            return "waiting: not enough healthy GPUs can hold this claim right now (drained or lost)"
        if short is not None:
            return short
        if lease.home and not remap:
            return "waiting for the GPU it was checkpointed from to be free"
        if lease.home:
            model = self.by_uuid[lease.home[0]].name
            return f"waiting for a {model} GPU to restore onto (a checkpoint goes back onto the model it came from)"
        return "waiting for a GPU"

    # -- reclaiming ------------------------------------------------------------------------
    def victims_for(self, blocked: list[Lease], usage: fairness.Usage, limits: _Limits) -> dict[str, str]:
        """Idle leases to take back so that waiting claims fit, with the reason for each
        (core/victims.py)."""
        return victims.victims_for(self, blocked, usage, limits)

    def uncontended(self, limits: _Limits) -> dict[str, str]:
        """Idle leases past their keep time (non-disruptive) or ``release_timeout`` (any step)."""
        out: dict[str, str] = {}
        if self.cfg.policy == "static":
            return out
        now, cfg, caps = self.now, self.cfg, self.caps
        release_after = cfg.release_timeout if cfg.release_timeout > 0 else None
        room = self.checkpoint_room()
        for lease in self.live():
            if lease.state not in HOLDING or lease.busy or lease.last_active_at is None or self.pinned(lease):
                continue
            idle_for = lease.idle_seconds(now)
            step, _ = ladder.choose_step(lease, cfg, caps, room)
            gentle = step in _GENTLE
            timeouts = limits.of(lease)
            limit = timeouts.keep_after if gentle else release_after
            if limit is None:
                continue
            if idle_for >= limit:
                if step == Step.CHECKPOINT and room is not None:
                    room -= lease.memory_held or 0
                if gentle and (release_after is None or idle_for < release_after):
                    # Taken back now only because the step keeps the kernel's state.
                    self.gentle_only.add(lease.id)
                if release_after is not None and limit >= release_after:
                    why = f"idle for over {format_duration(release_after)}, the release_timeout, with nobody waiting"
                else:
                    why = f"idle for over {format_duration(limit)} with nobody waiting; {timeouts.reason}"
                out[lease.id] = why
            else:
                self.wake(lease.last_active_at + limit)
        return out

    def reclaim(self, wanted: Mapping[str, str]) -> None:
        for lease in self.live():
            if lease.state != LeaseState.RECLAIMING or lease.id in wanted or lease.over_share_since is not None:
                continue  # (a lease over its memory share: over_share decides)
            in_progress = lease.reclaim_step is not None and not lease.reclaim_step.disruptive
            if not in_progress:
                reason = "reclaim cancelled: no longer needed"
                if lease.reclaim_step is not None and self.gently_served:
                    # A disruptive step announced earlier, called off because the waiting claim
                    # is now served by a step that keeps every kernel's state.
                    reason = (
                        f"{lease.reclaim_step} called off: the waiting claim is served without it, "
                        "by a GPU freed without losing any kernel's state"
                    )
                self.set(
                    evolve(lease, state=LeaseState.IDLE, reclaim_at=None, reclaim_step=None, reason=reason),
                    "cancel",
                    reason,
                )
        # The leases taken back with steps that keep state for a waiting claim take their share
        # of the checkpoint budget first (victims_for counted on it), then the other claims'.
        for lease_id in sorted(wanted, key=lambda i: (i not in self.gentle_victims, i)):
            lease = self.leases[lease_id]
            why = wanted[lease_id]
            if lease.state == LeaseState.RECLAIMING:
                if lease.reclaim_step is not None and not lease.reclaim_step.disruptive:
                    continue  # being carried out; the arbiter reports back
                step, how = self.step_for(lease, reserve=True)
                if step is not None and not step.disruptive and step not in lease.tried_steps:
                    # Announced as a restart or shutdown, but now a step that keeps the kernel's
                    # state can be taken (room came back in the checkpoint budget): take that.
                    reason = f"{why}; {how} (instead of the {lease.reclaim_step} announced)"
                    self.set(
                        evolve(lease, reclaim_at=self.now, reclaim_step=step, reason=reason), "reclaim", reason
                    )
                    continue
                if lease.reclaim_at is not None and lease.reclaim_at <= self.now:
                    self.set(lease, "reclaim", f"{lease.reclaim_step}: {why}")
                else:
                    self.wake(lease.reclaim_at)
                continue
            step, how = self.step_for(lease, reserve=True)
            if step is None:
                continue
            if step.disruptive and lease.id in self.gentle_only:
                # The checkpoint it was due for no longer fits the host memory budget; a step
                # that loses its state waits for release_timeout.
                if self.cfg.release_timeout > 0 and lease.last_active_at is not None:
                    self.wake(lease.last_active_at + self.cfg.release_timeout)
                continue
            if step.disruptive:
                at = self.now + self.cfg.grace_period
                # When is in reclaim_at and the step in reclaim_step; the reason says why and how.
                reason = f"{why}; {how}"
                kind = "notice" if at > self.now else "reclaim"
                self.set(
                    evolve(lease, state=LeaseState.RECLAIMING, reclaim_at=at, reclaim_step=step, reason=reason),
                    kind,
                    reason,
                )
                self.wake(at)
            else:
                reason = f"{why}; {how}"
                self.set(
                    evolve(lease, state=LeaseState.RECLAIMING, reclaim_at=self.now, reclaim_step=step, reason=reason),
                    "reclaim",
                    reason,
                )

    # -- a shared lease over its memory share (core/overshare.py) --------------------------
    def over_share(self, wanted: Mapping[str, str]) -> None:
        overshare.respond(self, wanted)


def plan(
    devices: Sequence[Device],
    leases: Iterable[Lease],
    activity: Mapping[str, KernelActivity],
    now: float,
    cfg: SchedConfig,
    caps: Capabilities = Capabilities(),
    usage: Mapping[str, float] | None = None,
    running: AbstractSet[str] = frozenset(),
) -> Plan:
    """Run one scheduling pass over the live leases (released ones are ignored).

    ``usage``: each subject's recent usage in GPU-seconds (``core.usage.recent``); it orders the
    queue after quota and the borrowed leases to reclaim. Ignored when ``cfg.usage_half_life``
    is 0; ``None``: nobody used anything yet.

    ``running``: kernels whose host says they run a cell now, whether or not ``activity`` counts
    them busy (a hub broker counts a server's word only with evidence). Such a kernel's idle lease
    is taken for a waiting claim only where no idle kernel's lease can serve it, now or once its
    own idle time is up.
    """
    live = [lease for lease in leases if lease.state in LIVE]
    return _Pass(devices, live, activity, now, cfg, caps, usage, running).run()
