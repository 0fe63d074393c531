"""What the reclaim executor decides from what it has read: pure functions, no I/O.

Which processes a reclaim touches (:func:`gpu_pids`), whether a checkpoint fits in the host
memory left for checkpoints and in each process's memory cgroup (:func:`held_on_lease`,
:func:`over_host_budget`, :func:`over_cgroup`), and whether a restore fits on its GPUs
(:func:`room_short`, :func:`restore_needs`, :func:`orphan_needs`). The executor reads the GPUs,
the process trees and the cgroups, and hands what it read to these.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, AbstractSet, Iterable, Mapping, Sequence

from .. import core
from ..core import Lease, ladder
from ..core.ladder import checkpoint_bytes
from ..core.placement import RESTORE_MARGIN

if TYPE_CHECKING:
    from ..devices.base import DeviceSnapshot
    from ..ledger import Checkpoint


def gpu_pids(lease: Lease, snapshot: Iterable[DeviceSnapshot], tree: AbstractSet[int]) -> list[int]:
    """The processes of ``tree`` (the kernel's process tree) that use the lease's own GPUs: the
    only ones a reclaim touches. A process elsewhere, or on another GPU, is never acted on."""
    pids = []
    for device in snapshot:
        if device.uuid in lease.devices:
            pids.extend(p.pid for p in device.processes if p.pid in tree)
    return sorted(set(pids))


def held_on_lease(lease: Lease, pids: Iterable[int], snapshot: Iterable[DeviceSnapshot]) -> dict[int, int]:
    """Pid -> bytes each of ``pids`` holds on the lease's GPUs now (a memory not reported counts 0)."""
    pids = set(pids)
    sizes: dict[int, int] = {}
    for device in snapshot:
        if device.uuid in lease.devices:
            for p in device.processes:
                if p.pid in pids:
                    sizes[p.pid] = sizes.get(p.pid, 0) + (p.memory_used or 0)
    return sizes


def over_host_budget(lease: Lease, sizes: Mapping[int, int], budget: int | None, leases: Iterable[Lease]) -> str | None:
    """Why checkpointing ``lease``'s processes (``sizes``, as :func:`held_on_lease` says; none
    reported: what the lease last held) would take the host's checkpoints over ``budget`` bytes
    (``checkpoint_host_memory``; None: no limit), counting those the other ``leases`` hold; None
    where it fits."""
    if budget is None:
        return None
    size = sum(sizes.values()) or lease.memory_held or 0
    others = checkpoint_bytes(le for le in leases if le.id != lease.id)
    return ladder.over_budget(replace(lease, memory_held=size), budget - others)


def over_cgroup(sizes: Mapping[int, int], rooms: Mapping[int, int | None]) -> str | None:
    """Why a process's checkpoint would get it killed: its GPU memory (``sizes``) would not fit
    in what its memory cgroup (a pod's limit) leaves it (``rooms``; None or absent: no limit
    known); None where each fits. The lowest such pid is named."""
    for pid, held in sorted(sizes.items()):
        room = rooms.get(pid)
        if room is not None and held > room:
            return (
                f"process {pid}'s {core.format_bytes(held)} of GPU memory would not fit in the "
                f"{core.format_bytes(room)} its memory limit (cgroup) leaves it"
            )
    return None


def room_short(snapshot: Sequence[DeviceSnapshot], needs: Mapping[str, int]) -> str | None:
    """Why a restore must wait: a target GPU's free memory (what its processes leave, leased
    or not) is below what the checkpoint needs there (``needs``: uuid -> bytes, margin
    included); None where every target has room, or its memory in use is not reported."""
    by_uuid = {d.uuid: d for d in snapshot}
    for uuid, need in sorted(needs.items()):
        device = by_uuid.get(uuid)
        if device is None or device.memory_used is None:
            continue
        free = max(0, device.memory_total - device.memory_used)
        if need > free:
            return (
                f"waiting for room to restore: GPU {device.index} has {core.format_bytes(free)} free, too little "
                f"for its {core.format_bytes(need - RESTORE_MARGIN)} checkpoint (and a "
                f"{core.format_bytes(RESTORE_MARGIN)} margin); it is restored once enough memory is free"
            )
    return None


def per_device(total: int, devices: Iterable[str]) -> dict[str, int]:
    """``total`` bytes spread evenly over ``devices``, each with the restore margin."""
    devices = list(devices)
    share = -(-total // max(1, len(devices)))
    return {uuid: share + RESTORE_MARGIN for uuid in devices}


def restore_needs(lease: Lease, records: Sequence[Checkpoint]) -> dict[str, int]:
    """Free bytes each GPU granted to ``lease`` needs for its checkpoints ``records``: what they
    moved where known, else what the lease's kernel held when it was checkpointed."""
    if not records:
        return {}
    sizes = [r.memory for r in records]
    total = sum(s for s in sizes if s is not None) if all(s is not None for s in sizes) else lease.memory_held
    if total is None:
        return {}
    return per_device(total, lease.devices)


def orphan_needs(record: Checkpoint, lease: Lease) -> dict[str, int]:
    """Free bytes each GPU an orphaned checkpoint came from needs to take it back."""
    total = record.memory if record.memory is not None else lease.memory_held
    return {} if total is None else per_device(total, record.devices)
