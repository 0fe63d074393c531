"""Placement: which devices a claim gets.

``exclusive`` claims take devices nobody holds, least loaded first. ``shared`` claims take the
device whose free promised memory fits them most tightly (best fit), so that large holes stay open
for large claims. Multi-GPU claims prefer devices of one ``group`` (NVLink clique or PCIe switch).
A physical GPU split into MIG instances is never handed out whole; drained and lost devices are
never chosen.

A claim that restores a checkpoint (a suspended lease resumed) must also find its checkpoint's
size, plus :data:`RESTORE_MARGIN`, in the GPU's real free memory: memory that processes outside
the leases holding the GPU use (a job started outside Jupyter, a kernel that gave its lease back
and kept its memory) counts as taken. A restore into too little memory fails in the driver and
can leave the process stuck checkpointed for good (NVIDIA/cuda-checkpoint#44).

Every other claim counts that memory as taken too: a kernel that gave its lease back and kept
its memory, or a job started outside Jupyter, leaves a GPU free by the leases' books but not in
fact. A claim goes there only if it fits beside that memory: an exclusive claim for a size needs
that size free, a claim for a whole GPU needs the GPU empty (up to :data:`STRAY_SLACK`), a shared
claim needs its share free beside the other leases' shares and that memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Iterable, Sequence

from .model import EXCLUSIVE, GiB, Device, Lease

#: Free memory a restore needs on each GPU beyond its checkpoint's share: the driver's own
#: context and what the restore allocates while it copies (bytes).
RESTORE_MARGIN = GiB // 2
#: Bytes of memory outside every lease that a GPU may hold and still count as empty for a new
#: claim: a CUDA context or two left behind by processes that freed their memory (a few hundred
#: MiB each on current GPUs), a display server. Beyond it, all of that memory counts as taken.
STRAY_SLACK = GiB


@dataclass(frozen=True)
class Occupancy:
    """What the live leases have been promised on one device, what their kernels hold there
    (``held``), and what processes outside them use there (``outside``: the device's memory used
    less what the holders' kernels hold)."""

    exclusive: bool
    promised: int
    holders: int
    outside: int = 0
    held: int = 0


def own_memory(device: Device, kernel_id: str) -> int:
    """Bytes ``kernel_id``'s processes hold on ``device`` outside its leases."""
    return sum(size for kid, size in device.kernel_memory if kid == kernel_id)


def stray(device: Device, occ: Occupancy, lease: Lease) -> int:
    """Bytes outside every lease on ``device`` that ``lease``, a new claim, counts as taken: not
    what its own kernel holds there, and none up to :data:`STRAY_SLACK` (all of it beyond)."""
    outside = occ.outside
    if outside and device.kernel_memory:
        outside -= own_memory(device, lease.kernel_id)
    return outside if outside > STRAY_SLACK else 0


def held_per_device(lease: Lease) -> int:
    """Bytes a holding lease's kernel holds on each of its GPUs (its total spread evenly)."""
    return -(-(lease.memory_held or 0) // max(1, len(lease.devices)))


def outside_memory(device: Device, held: int) -> int:
    """Bytes used on ``device`` by processes outside the leases that hold it."""
    return max(0, (device.memory_used or 0) - held)


def occupancy(devices: Sequence[Device], leases: Iterable[Lease]) -> dict[str, Occupancy]:
    """Promised memory and exclusivity per device uuid, from the leases that hold devices."""
    by_uuid = {d.uuid: d for d in devices}
    excl: dict[str, bool] = {d.uuid: False for d in devices}
    promised: dict[str, int] = {d.uuid: 0 for d in devices}
    holders: dict[str, int] = {d.uuid: 0 for d in devices}
    held: dict[str, int] = {d.uuid: 0 for d in devices}
    for lease in leases:
        if not lease.holding:
            continue
        for uuid in lease.devices:
            device = by_uuid.get(uuid)
            if device is None:
                continue
            holders[uuid] += 1
            if lease.mode == EXCLUSIVE:
                excl[uuid] = True
            promised[uuid] += lease.promised_memory(device)
            held[uuid] += held_per_device(lease)
    return {
        u: Occupancy(excl[u], promised[u], holders[u], outside_memory(d, held[u]), held[u]) for u, d in by_uuid.items()
    }


def occupy(occ: dict[str, Occupancy], lease: Lease, devices: Mapping[str, Device]) -> None:
    """Add a lease just placed to an occupancy map, in place."""
    _shift(occ, lease, devices, +1)


def vacate(occ: dict[str, Occupancy], lease: Lease, devices: Mapping[str, Device]) -> None:
    """Take a lease that is going away out of an occupancy map, in place."""
    _shift(occ, lease, devices, -1)


def _shift(occ: dict[str, Occupancy], lease: Lease, devices: Mapping[str, Device], sign: int) -> None:
    exclusive = lease.mode == EXCLUSIVE
    for uuid in lease.devices:
        old = occ.get(uuid)
        device = devices.get(uuid)
        if old is None or device is None:
            continue
        occ[uuid] = Occupancy(
            (old.exclusive or exclusive) if sign > 0 else (old.exclusive and not exclusive),
            max(0, old.promised + sign * lease.promised_memory(device)),
            max(0, old.holders + sign),
            old.outside,
            max(0, old.held + sign * held_per_device(lease)),
        )


def schedulable(devices: Sequence[Device]) -> list[Device]:
    """Healthy devices, without physical GPUs that are split into MIG instances."""
    parents = {d.parent for d in devices if d.parent}
    return [d for d in devices if d.schedulable and d.uuid not in parents]


def restore_need(lease: Lease) -> int | None:
    """Free bytes each GPU needs to take ``lease``'s checkpoint back (its share of the
    checkpoint plus :data:`RESTORE_MARGIN`); ``None`` if the lease restores nothing or the
    checkpoint's size is unknown."""
    if not lease.home or lease.memory_held is None:
        return None
    return -(-lease.memory_held // max(1, len(lease.home))) + RESTORE_MARGIN


def fits(device: Device, occ: Occupancy, lease: Lease) -> bool:
    """Whether ``lease`` can be placed on ``device`` next to what it already holds."""
    if occ.exclusive:
        return False
    # A claim's memory is what each of its GPUs must have, whatever the mode: an exclusive
    # "40GiB" claim must not land on a 10 GiB MIG slice.
    if lease.memory is not None and lease.memory > device.memory_total:
        return False
    restoring = restore_need(lease) if lease.home else None
    if lease.mode == EXCLUSIVE:
        if occ.holders != 0:
            return False
        if restoring is not None:
            return restoring <= device.memory_total - occ.outside
        # Memory outside every lease is someone's: a claim for a size fits beside it, a claim
        # for the whole GPU does not.
        taken = stray(device, occ, lease)
        return taken == 0 or (lease.memory is not None and lease.memory <= device.memory_total - taken)
    need = lease.promised_memory(device)
    if restoring is not None:
        # By the books (what the holders were promised) and in fact (what their kernels hold,
        # which may be more than a shared lease's share).
        room = device.memory_total - occ.outside
        return occ.promised + max(need, restoring) <= room and occ.held + restoring <= room
    return occ.promised + need <= device.memory_total - stray(device, occ, lease)


def restore_short(device: Device, occ: Occupancy, lease: Lease) -> int | None:
    """Free bytes ``device`` has for ``lease``'s restore when that is all that keeps the restore
    off it (it fits by the leases' books but its real free memory is too small); else ``None``."""
    need = restore_need(lease)
    if need is None or not occ.outside or fits(device, occ, lease):
        return None
    if not fits(device, Occupancy(occ.exclusive, occ.promised, occ.holders), lease):
        return None
    taken = max(occ.promised, occ.held) if lease.mode != EXCLUSIVE else 0
    return max(0, device.memory_total - occ.outside - taken)


def _load_key(device: Device) -> tuple:
    return (device.utilization or 0.0, device.memory_used or 0, device.index, device.uuid)


def _order(lease: Lease, candidates: list[Device], occ: Mapping[str, Occupancy]) -> list[Device]:
    # A GPU where the claim's kernel still holds memory comes first: CUDA in that kernel may be
    # initialized there already, and its memory is there.
    def own(device: Device) -> int:
        return 0 if device.kernel_memory and own_memory(device, lease.kernel_id) else 1

    if lease.mode == EXCLUSIVE:
        return sorted(candidates, key=lambda d: (own(d), *_load_key(d)))

    def leftover(device: Device) -> tuple:
        taken = occ[device.uuid]
        left = device.memory_total - stray(device, taken, lease) - taken.promised - lease.promised_memory(device)
        return (own(device), left, *_load_key(device))

    return sorted(candidates, key=leftover)


def place(
    lease: Lease,
    devices: Sequence[Device],
    leases: Iterable[Lease],
    *,
    only: Iterable[str] | None = None,
    same_model_as: Sequence[Device] = (),
    occ: Mapping[str, Occupancy] | None = None,
    pool: Sequence[Device] | None = None,
) -> tuple[tuple[str, ...], str] | None:
    """Choose devices for ``lease`` or return ``None`` if it does not fit now.

    ``only`` restricts the choice to these uuids (a restore that must go back home);
    ``same_model_as`` to devices of the same model as those (a restore that may move).
    ``occ`` is the occupancy of ``leases`` when the caller keeps it already (a scheduling pass
    placing many claims in turn), ``pool`` the schedulable devices likewise. Returns the chosen
    uuids and a reason.
    """
    if occ is None:
        occ = occupancy(devices, leases)
    if pool is None:
        pool = schedulable(devices)
    candidates = [d for d in pool if fits(d, occ[d.uuid], lease)]
    if only is not None:
        allowed = set(only)
        candidates = [d for d in candidates if d.uuid in allowed]
    if same_model_as:
        models = {d.name for d in same_model_as}
        candidates = [d for d in candidates if d.name in models]
    if len(candidates) < lease.count:
        return None
    ordered = _order(lease, candidates, occ)
    if lease.count == 1:
        chosen = ordered[0]
        how = "least loaded free GPU" if lease.mode == EXCLUSIVE else "best fit by memory"
        return (chosen.uuid,), f"{how}: GPU {chosen.index}"

    groups: dict[str, list[Device]] = {}
    for device in ordered:
        if device.group is not None:
            groups.setdefault(device.group, []).append(device)
    fitting = [(len(members), name) for name, members in groups.items() if len(members) >= lease.count]
    if fitting:
        # The tightest group keeps bigger groups whole for bigger claims.
        _, name = min(fitting)
        chosen_devices = groups[name][: lease.count]
        indices = ", ".join(str(d.index) for d in chosen_devices)
        return tuple(d.uuid for d in chosen_devices), f"GPUs {indices} in one NVLink group ({name})"
    chosen_devices = ordered[: lease.count]
    indices = ", ".join(str(d.index) for d in chosen_devices)
    spans = " (no single NVLink group has enough free)" if groups else ""
    return tuple(d.uuid for d in chosen_devices), f"GPUs {indices}{spans}"


def capacity_for(lease: Lease, devices: Sequence[Device]) -> int:
    """How many devices could ever hold a claim like this one (ignoring who holds them now)."""
    empty = Occupancy(False, 0, 0)
    return sum(1 for d in schedulable(devices) if fits(d, empty, lease))


def device_map(home: Sequence[str], targets: Sequence[str], models: Mapping[str, str]) -> dict[str, str] | None:
    """The map (old uuid -> new uuid) a restore from ``home`` onto ``targets`` hands the driver,
    by its rules: every GPU of ``home`` is mapped, each onto a GPU of the same model (``models``:
    uuid -> device name), a GPU that is in both onto itself. ``None`` where no such map exists."""
    if len(home) != len(targets) or len(set(targets)) != len(targets):
        return None
    out = {u: u for u in home if u in targets}
    left = [t for t in targets if t not in out]
    for old in home:
        if old in out:
            continue
        model = models.get(old)
        new = next((t for t in left if model is not None and models.get(t) == model), None)
        if new is None:
            return None
        left.remove(new)
        out[old] = new
    return out
