"""The history as an audit: which events a lease change writes, and the checks that replay them.

The events table is append-only (triggers refuse UPDATE and DELETE, see :mod:`.schema`), and
:meth:`Transaction.put` writes every change of held devices itself, so replaying the history must
end where the leases table stands; :func:`check_history` says where it does not.

Retention (:meth:`Transaction.prune`) is the one exception: a released lease is deleted together
with its whole history, and the schema lets a lease's events go only once the lease is gone. A
released lease holds nothing, so its history, replayed on its own, gives back every device it
took; removing it whole neither hides nor invents a holder of any other lease, and the replay of
what remains still ends where the leases table stands. What the replay can no longer see is a
double grant in which a pruned lease took part: the check covers the retained window, and the
``pruned`` table (one row, :meth:`Ledger.pruned`) says how much went before it.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from ..core import EXCLUSIVE, Device, Lease, LeaseState
from .rows import Event, Owner

__all__ = [
    "ACQUIRE_KINDS",
    "CLAIM",
    "FREE_KINDS",
    "GRANT",
    "RELEASE",
    "RESTORE",
    "SUSPEND",
    "check_history",
    "check_state",
    "held_devices",
    "transition_events",
]

#: Event kinds that :meth:`Transaction.put` writes.
CLAIM = "claim"
GRANT = "grant"
RESTORE = "restore"
SUSPEND = "suspend"
RELEASE = "release"
#: Event kinds that give a lease devices, and those that take them away.
ACQUIRE_KINDS = frozenset({GRANT, RESTORE})
FREE_KINDS = frozenset({SUSPEND, RELEASE})


def held_devices(lease: Lease | None) -> tuple[str, ...]:
    if lease is None or not lease.holding:
        return ()
    return lease.devices


def transition_events(before: Lease | None, after: Lease, now: float) -> list[Event]:
    """The history lines for writing ``after`` over ``before``."""

    def event(kind: str, devices: Iterable[str]) -> Event:
        return Event(kind, now, after.id, after.kernel_id, tuple(devices), after.reason)

    out: list[Event] = []
    if before is None:
        out.append(event(CLAIM, ()))
    old, new = held_devices(before), held_devices(after)
    lost = [u for u in old if u not in new]
    gained = [u for u in new if u not in old]
    # Free before grant, so that a lease moved between devices never appears to hold both.
    if lost:
        out.append(event(SUSPEND if after.state == LeaseState.SUSPENDED else RELEASE, lost))
    elif after.state == LeaseState.RELEASED and (before is None or before.state != LeaseState.RELEASED):
        out.append(event(RELEASE, ()))
    if gained:
        out.append(event(RESTORE if after.home else GRANT, gained))
    return out


def check_state(
    leases: list[Lease], owners: Mapping[str, Owner], dead: Mapping[str, Owner], devices: Sequence[Device] | None
) -> list[str]:
    problems: list[str] = []
    by_uuid = {d.uuid: d for d in devices} if devices is not None else None
    holders: dict[str, list[Lease]] = {}
    kernels: dict[str, list[str]] = {}
    for lease in leases:
        if not lease.live:
            if lease.devices:
                problems.append(f"lease {lease.id} is released but still lists devices {', '.join(lease.devices)}")
            continue
        kernels.setdefault(lease.kernel_id, []).append(lease.id)
        if lease.holding:
            if len(lease.devices) != lease.count or len(set(lease.devices)) != len(lease.devices):
                problems.append(
                    f"lease {lease.id} is {lease.state.value} with devices {list(lease.devices)} "
                    f"for a claim of {lease.count}"
                )
            for uuid in lease.devices:
                holders.setdefault(uuid, []).append(lease)
        elif lease.devices:
            problems.append(f"lease {lease.id} is {lease.state.value} but lists devices {', '.join(lease.devices)}")
        owner = owners.get(lease.id)
        if owner is None:
            problems.append(
                f"live lease {lease.id} of kernel {lease.kernel_id} has no owner; nothing would ever release it"
            )
        elif dead.get(lease.id) == owner:
            problems.append(
                f"live lease {lease.id} of kernel {lease.kernel_id} belongs to process {owner.process.pid}, "
                "which is gone (reap_dead_owners releases it)"
            )
    for kernel_id, ids in kernels.items():
        if len(ids) > 1:
            problems.append(f"kernel {kernel_id} has {len(ids)} live leases: {', '.join(ids)}")
    for uuid, held_by in sorted(holders.items()):
        exclusive = [le for le in held_by if le.mode == EXCLUSIVE]
        if exclusive and len(held_by) > 1:
            ids = ", ".join(le.id for le in held_by)
            problems.append(
                f"device {uuid} is held by {len(held_by)} leases, {len(exclusive)} of them exclusive: {ids}"
            )
        if by_uuid is None:
            continue
        device = by_uuid.get(uuid)
        if device is None:
            problems.append(f"device {uuid} is held by lease {held_by[0].id} but is not in the inventory")
            continue
        promised = sum(le.promised_memory(device) for le in held_by)
        if not exclusive and promised > device.memory_total:
            problems.append(
                f"device {uuid} (GPU {device.index}) is promised {promised} bytes but has {device.memory_total}: "
                + ", ".join(le.id for le in held_by)
            )
    return problems


def check_history(leases: list[Lease], events: list[Event]) -> list[str]:
    problems: list[str] = []
    modes = {lease.id: lease.mode for lease in leases}
    holders: dict[str, dict[str, str]] = {}
    for event in events:
        if event.kind not in ACQUIRE_KINDS | FREE_KINDS:
            continue
        if event.lease_id not in modes:
            problems.append(f"event {event.seq} ({event.kind}) is about lease {event.lease_id}, which the ledger lacks")
            continue
        mode = modes[event.lease_id]
        for uuid in event.devices:
            held = holders.setdefault(uuid, {})
            if event.kind in ACQUIRE_KINDS:
                if held and (mode == EXCLUSIVE or EXCLUSIVE in held.values()):
                    problems.append(
                        f"device {uuid} was granted to lease {event.lease_id} (event {event.seq}) while lease "
                        f"{', '.join(sorted(held))} held it"
                    )
                held[event.lease_id] = mode
            elif held.pop(event.lease_id, None) is None:
                problems.append(f"lease {event.lease_id} freed device {uuid} (event {event.seq}) without holding it")
    replayed = {(lid, uuid) for uuid, held in holders.items() for lid in held}
    current = {(lease.id, uuid) for lease in leases for uuid in held_devices(lease)}
    for lid, uuid in sorted(current - replayed):
        problems.append(f"lease {lid} holds device {uuid} but the history never granted it")
    for lid, uuid in sorted(replayed - current):
        problems.append(f"the history says lease {lid} holds device {uuid} but the lease does not")
    return problems
