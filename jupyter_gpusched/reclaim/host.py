"""``ReclaimHost``: what the reclaim executor needs from the arbiter it works for.

The executor carries out the steps a pass decided; everything else it needs comes through this
protocol, and nothing more: the clock, the last view of the GPUs and the leases (read only), each
kernel's process tree, the ledger (checkpoint records), the checkpointer, and one way to change a
lease (:meth:`ReclaimHost.update`, one ledger transaction). :class:`~jupyter_gpusched.arbiter.local.LocalArbiter`
implements it; a test can hand the executor a small host of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Callable, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from ..arbiter.base import ArbiterEvent, KernelHost
    from ..core import Capabilities, Lease, SchedConfig
    from ..devices.base import DeviceBackend, DeviceSnapshot
    from ..ledger import Ledger
    from .checkpoint import Checkpointer


class ReclaimView(Protocol):
    """The host's last view of the world, read only."""

    @property
    def snapshot(self) -> Sequence[DeviceSnapshot]:
        """The GPUs as last seen, with their processes."""

    @property
    def leases(self) -> Sequence[Lease]:
        """The live leases as last planned or written."""


class ReclaimMetrics(Protocol):
    def reclaimed(self, step: str) -> None:
        """One reclaim step of kind ``step`` was carried out."""


@runtime_checkable
class ReclaimHost(Protocol):
    """Every member the reclaim executor uses of its host (``LocalArbiter``)."""

    #: What the checkpointer refused for good: the executor adds GPUs it found it cannot serve.
    caps: Capabilities

    @property
    def clock(self) -> Callable[[], float]:
        """The host's clock (seconds; a test's fake one moves only when told to)."""

    @property
    def state(self) -> ReclaimView: ...

    @property
    def trees(self) -> Mapping[str, AbstractSet[int]]:
        """Each kernel's process tree as last observed: a reclaim acts within it only."""

    @property
    def kernels(self) -> KernelHost | None:
        """The kernels (asked whether one runs a cell, restarted, shut down); None: none here."""

    @property
    def backend(self) -> DeviceBackend | None:
        """The GPUs, read afresh before a restore; None: no inventory (the last view is used)."""

    @property
    def ledger(self) -> Ledger:
        """Where every checkpoint is recorded before anything else happens."""

    @property
    def checkpointer(self) -> Checkpointer: ...

    @property
    def cfg(self) -> SchedConfig:
        """Scheduling settings (``checkpoint_host_memory``)."""

    @property
    def metrics(self) -> ReclaimMetrics | None: ...

    async def update(self, lease: Lease, fn: Callable[[Lease, float], Lease | None]) -> Lease | None:
        """Re-read ``lease`` under the ledger's write lock and write ``fn(lease, now)`` where it
        is not None; returns the lease written, or None where nothing was."""

    def publish(self, event: ArbiterEvent) -> None:
        """Tell viewers (a notice for the lease's user)."""

    def mine(self, lease: Lease) -> bool:
        """Whether ``lease``'s kernel is one of this host's (its reclaims are carried out here)."""

    def wake(self, lease_id: str) -> None:
        """Wake a claim waiting on ``lease_id`` (a restore is over)."""

    def live_lease(self, lease_id: str) -> Lease | None:
        """A live lease as last seen."""

    def known_lease(self, lease_id: str) -> Lease | None:
        """A lease, live or from the ledger's history (None: never heard of)."""
