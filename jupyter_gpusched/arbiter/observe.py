"""Observing: what each kernel does, from the kernel host and the GPUs' process lists.

:func:`observe` is the first step of every reconcile tick. It maps the processes on each GPU to
kernels through the kernels' process trees and counts only what a kernel holds on its lease's
own GPUs; the rest is reported as outside every lease.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from ..core import Device, KernelActivity, Lease
from ..devices.base import DeviceSnapshot


@dataclass(frozen=True)
class Observation:
    """One look at the kernels: their activity, and which GPU processes are whose."""

    activity: Mapping[str, KernelActivity] = field(default_factory=dict)
    #: GPU process -> the kernel whose tree it is in.
    process_kernels: Mapping[int, str] = field(default_factory=dict)
    #: GPU processes outside every lease (``kernel_id`` set: a kernel's, on a GPU it does not hold).
    unleased: tuple[dict, ...] = ()
    #: Each kernel's process tree, as the kernel host found it.
    trees: Mapping[str, set[int]] = field(default_factory=dict)


def observe(
    states: Mapping[str, tuple[bool, float | None, float | None]],
    trees: Mapping[str, set[int]],
    snapshot: Iterable[DeviceSnapshot],
    leases: Iterable[Lease],
    now: float,
    *,
    has_inventory: bool,
) -> Observation:
    """Kernel activity (``states`` from the kernel host) with GPU use mapped through process trees."""
    pid_kernel: dict[int, str] = {}
    for kernel_id in states:
        for pid in trees.get(kernel_id, ()):
            pid_kernel[pid] = kernel_id
    memory: dict[str, int] = {}
    util: dict[str, float | None] = {}
    unleased = []
    held = {lease.kernel_id: set(lease.devices) for lease in leases if lease.holding}
    for device in snapshot:
        for proc in device.processes:
            kernel_id = pid_kernel.get(proc.pid)
            if kernel_id is None:
                unleased.append({"pid": proc.pid, "device": device.uuid, "memory_used": proc.memory_used})
                continue
            if device.uuid not in held.get(kernel_id, ()):
                # A kernel of this host on a GPU it holds no lease for: reported, never counted
                # as its lease's use (and never checkpointed with it).
                unleased.append(
                    {"pid": proc.pid, "device": device.uuid, "memory_used": proc.memory_used, "kernel_id": kernel_id}
                )
                continue
            memory[kernel_id] = memory.get(kernel_id, 0) + (proc.memory_used or 0)
            if proc.utilization is not None:
                util[kernel_id] = (util.get(kernel_id) or 0.0) + proc.utilization
            else:
                util.setdefault(kernel_id, None)
    activity = {}
    for kernel_id, (busy, last_busy_at, started_at) in states.items():
        activity[kernel_id] = KernelActivity(
            kernel_id=kernel_id,
            busy=busy,
            last_busy_at=min(last_busy_at, now) if last_busy_at is not None else None,
            started_at=started_at,
            gpu_utilization=util.get(kernel_id),
            gpu_memory=memory.get(kernel_id, 0) if has_inventory else None,
        )
    return Observation(activity, pid_kernel, tuple(unleased), dict(trees))


def core_devices(
    snapshot: Iterable[DeviceSnapshot], drained: Iterable[str], unleased: Iterable[dict]
) -> list[Device]:
    """The devices as the scheduler sees them, each with what kernels hold there outside their
    leases (``unleased``, as :func:`observe` reports it): that memory counts as taken for every
    claim but the kernel's own."""
    drained = set(drained)
    held: dict[str, dict[str, int]] = {}
    for item in unleased:
        kernel_id = item.get("kernel_id")
        if kernel_id and item.get("memory_used"):
            on = held.setdefault(item["device"], {})
            on[kernel_id] = on.get(kernel_id, 0) + item["memory_used"]
    out = []
    for snap in snapshot:
        device = snap.to_core(drained=snap.uuid in drained)
        if snap.uuid in held:
            device = replace(device, kernel_memory=tuple(sorted(held[snap.uuid].items())))
        out.append(device)
    return out


def held_by_kernel(snapshot: Iterable[DeviceSnapshot], pids: set[int], devices: Iterable[str]) -> list[dict]:
    """What a kernel's processes (``pids``) hold on ``devices`` (uuids), from the GPUs' own
    process lists: one ``{pid, device, index, memory_used}`` per process and GPU holding memory."""
    wanted = set(devices)
    out = []
    for device in snapshot:
        if device.uuid not in wanted:
            continue
        for proc in device.processes:
            if proc.pid in pids and proc.memory_used:
                out.append({"pid": proc.pid, "device": device.uuid, "index": device.index, "memory_used": proc.memory_used})
    return out


def device_changed(old: DeviceSnapshot, new: DeviceSnapshot) -> bool:
    """Changes worth telling the browser about (not every percent of utilization)."""

    def coarse(d: DeviceSnapshot):
        return (
            d.health,
            None if d.utilization is None else round(d.utilization / 5),
            None if d.memory_used is None else d.memory_used >> 26,
            tuple(sorted(p.pid for p in d.processes)),
        )

    return coarse(old) != coarse(new)
