"""Which leases end because their kernel is gone, or their GPU lost, at a reconcile tick.

A lease of a kernel the host no longer knows ends, unless the lease's owner is the kernel's own
process and it still runs (its GPU memory with it): then it ends with that process. A lease whose
owner process exited ends only if it is still gone at the next tick (a deliberate restart that
the tick raced with keeps it). A lease on a lost GPU is ended by ``core.device_lost``.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable, Iterable

from .. import core
from ..core import Lease
from ..ledger import OwnerId, is_alive
from .base import ArbiterEvent, KernelHost

log = logging.getLogger("jupyter_gpusched")


class Reaper:
    """``reap`` at each tick; ``suspects`` carries the leases whose owner was gone at the last one."""

    def __init__(self, kernels: Callable[[], KernelHost | None], server_id: Callable[[], str]) -> None:
        self.kernels = kernels
        self.server_id = server_id
        #: Leases whose owner process was gone at the last tick (ended if still gone at the next).
        self.suspects: frozenset[str] = frozenset()
        #: Leases kept although their host no longer knows the kernel: its process still runs.
        self._kept: set[str] = set()

    def reap(self, tx, leases: list[Lease], now: float, devices, notices: list) -> tuple[list[Lease], list[Lease], set[str]]:
        """Release leases whose kernels are gone and leases on lost GPUs."""
        owners = tx.owners()
        lost = {d.uuid: d for d in devices if d.health == core.Health.LOST}
        out, released = [], []
        suspects: set[str] = set()
        for lease in leases:
            owner = owners.get(lease.id)
            gone: str | None = None
            ours = self.kernels() is not None and (owner is None or owner.server_id == self.server_id())
            if ours and self.kernels().restarting(lease.kernel_id):
                pass  # a deliberate restart keeps the lease; the new process takes it over
            elif ours and self.kernels().alive(lease.kernel_id) is False:
                # The host no longer knows the kernel. Where the lease's owner is the kernel's
                # own process and it still runs (its GPU memory with it), the lease ends when
                # that process does, not on the host's word alone.
                if not self._kernel_process_runs(lease, owner):
                    gone = "the kernel has shut down"
            elif owner is not None and not is_alive(owner):
                # A kernel of ours whose process just exited may be in a deliberate restart that
                # this tick raced with: it is released only if still gone at the next tick.
                if not ours or lease.id in self.suspects:
                    gone = f"the kernel's process {owner.process.pid} is gone"
                else:
                    suspects.add(lease.id)
            if gone is not None:
                done = core.released(lease, now, f"released: {gone}")
                tx.put(done)
                released.append(done)
                log.info("lease %s of kernel %s released: %s", lease.id, lease.kernel_id, gone)
                notices.append(ArbiterEvent("lease", lease=done))
                continue
            on_lost = [u for u in lease.devices if u in lost]
            if on_lost and lease.holding:
                device = lost[on_lost[0]]
                done = core.device_lost(lease, device.uuid, device.index, now)
                tx.put(done)
                log.warning("lease %s of kernel %s: GPU %s lost", lease.id, lease.kernel_id, device.uuid)
                notices.append(
                    {"kind": "lost", "lease_id": lease.id, "kernel_id": lease.kernel_id, "message": done.reason}
                )
                continue
            out.append(lease)
        return out, released, suspects

    def _kernel_process_runs(self, lease: Lease, owner: Any) -> bool:
        """Whether ``lease`` is owned by its kernel's own process (not by this server, which owns a
        lease until the kernel's process is known) and that process still runs."""
        if owner is None:
            return False
        process = owner.process
        if process.pid == os.getpid() and process.hostname == socket.gethostname():
            return False
        if not is_alive(owner):
            self._kept.discard(lease.id)
            return False
        if lease.id not in self._kept:
            self._kept.add(lease.id)
            log.warning(
                "lease %s of kernel %s kept: the kernel host no longer knows the kernel, but its process %s "
                "still runs; the lease ends when that process does",
                lease.id, lease.kernel_id, process.pid,
            )
        return True

    def adopt(self, tx, leases: Iterable[Lease]) -> None:
        """Let the kernel's own process own its lease once it runs (it outlives this server)."""
        kernels = self.kernels()
        if kernels is None:
            return
        owners = tx.owners()
        for lease in leases:
            owner = owners.get(lease.id)
            if owner is None or owner.server_id != self.server_id():
                continue
            pid = kernels.kernel_pid(lease.kernel_id)
            if pid is None or owner.process.pid == pid:
                continue
            try:
                process = OwnerId.of_pid(pid)
            except Exception:  # noqa: BLE001 - the kernel may be exiting right now
                continue
            tx.set_owner(lease.id, lease.kernel_id, self.server_id(), process)
            kernels.adopted(lease.kernel_id)
