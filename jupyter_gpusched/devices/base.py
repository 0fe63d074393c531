"""The device interface: one snapshot type and the backend contract.

A backend answers one question, ``snapshot()``: every GPU of the host with its static facts and
telemetry, read in one pass. Physical GPUs keep their driver index; MIG instances follow them,
numbered in the order of (parent index, instance), and name their physical GPU in
``parent_uuid``. Fields a driver cannot report are ``None``, never a made-up number.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from ..core.model import Device, Health

OK = "ok"
LOST = "lost"
HEALTH_STATES = (OK, LOST)

BACKENDS = ("auto", "nvml", "simulated")


class InventoryUnavailable(RuntimeError):
    """No GPU inventory: no NVIDIA library, no driver, or no GPU. The message says what to do."""


class DeviceLost(RuntimeError):
    """A GPU stopped answering (fell off the bus, needs a reset).

    Attributes:
        uuid: the lost device, where known.
    """

    def __init__(self, message: str, uuid: str | None = None) -> None:
        super().__init__(message)
        self.uuid = uuid


@dataclass(frozen=True)
class GPUProcess:
    """A process with a context on a GPU.

    Attributes:
        pid: process id, as the host sees it.
        memory_used: bytes it holds on that GPU (``None``: the driver does not say).
        utilization: its share of the GPU in percent over the last sampling window
            (``None``: the driver does not say).
    """

    pid: int
    memory_used: int | None = None
    utilization: float | None = None


@dataclass(frozen=True)
class DeviceSnapshot:
    """One GPU (physical or MIG instance) as a backend saw it in one pass.

    Attributes:
        uuid: ``GPU-...`` for a physical GPU, ``MIG-...`` for a MIG instance.
        index: physical GPUs keep the driver index; MIG instances are numbered after them.
        name: the product name (a MIG instance carries its profile, "... MIG 3g.40gb").
        memory_total: bytes.
        memory_used: bytes in use, ``None`` if unknown (and on a lost GPU).
        utilization: percent of the last sampling window the GPU was busy, ``None`` if unknown.
        health: ``"ok"`` or ``"lost"``.
        processes: the processes with a context on this GPU.
        architecture: "Hopper", "Ampere", ... or ``None``.
        numa_node: NUMA node the GPU hangs off, ``None`` if unknown.
        nvlink_group: id shared by GPUs that talk over NVLink, or failing that by GPUs behind
            one PCIe switch; ``None`` for a GPU on its own.
        parent_uuid: the physical GPU of a MIG instance.
        mig_profile: "3g.40gb" and the like for a MIG instance.
    """

    uuid: str
    index: int
    name: str
    memory_total: int
    memory_used: int | None = None
    utilization: float | None = None
    health: str = OK
    processes: tuple[GPUProcess, ...] = ()
    architecture: str | None = None
    numa_node: int | None = None
    nvlink_group: str | None = None
    parent_uuid: str | None = None
    mig_profile: str | None = None

    def __post_init__(self) -> None:
        if self.health not in HEALTH_STATES:
            raise ValueError(f"health of {self.uuid} must be one of {HEALTH_STATES}, not {self.health!r}")

    @property
    def lost(self) -> bool:
        return self.health == LOST

    def to_core(self, drained: bool = False) -> Device:
        """The scheduler's view of this device.

        Args:
            drained: an admin drained it; a lost device stays lost, which says more.
        """
        if self.health == LOST:
            health = Health.LOST
        elif drained:
            health = Health.DRAINED
        else:
            health = Health.OK
        return Device(
            uuid=self.uuid,
            index=self.index,
            name=self.name,
            memory_total=self.memory_total,
            health=health,
            group=self.nvlink_group,
            parent=self.parent_uuid,
            utilization=self.utilization,
            memory_used=self.memory_used,
        )


class DeviceBackend(abc.ABC):
    """A source of GPU inventory and telemetry.

    Implementations are safe to call from worker threads; callers keep blocking calls off the
    event loop.
    """

    #: Short name shown in the API's ``backend`` field.
    name: str = "base"

    @abc.abstractmethod
    def snapshot(self) -> tuple[DeviceSnapshot, ...]:
        """All devices of the host, read in one pass.

        A lost GPU is reported with health ``"lost"`` rather than failing the pass.

        Raises:
            InventoryUnavailable: the driver or its library cannot be reached at all.
        """

    def checkpoint_support(self) -> tuple[bool, str]:
        """Whether this backend can move a process's GPU memory to the host and back, and why."""
        return False, f"the {self.name} backend cannot checkpoint GPU processes"

    def close(self) -> None:
        """Release the driver; a later ``snapshot()`` opens it again."""

    def __enter__(self) -> DeviceBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def __getattr__(name: str) -> Any:
    # ``open_backend`` lives in .open, which imports the backends, which import this module;
    # resolving it on first use keeps ``from .devices.base import open_backend`` working
    # without an import cycle.
    if name == "open_backend":
        from .open import open_backend

        return open_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
