"""The arbiter's interface: what the REST API, the provisioner and the events websockets call.

:class:`Arbiter` is the whole interface; :class:`~.local.LocalArbiter` runs the scheduler in this
process (standalone, and inside the hub broker), :class:`~.remote.BrokerClient` asks the hub's
broker. Both answer every call here, so a caller never needs to find out which one it holds.
:class:`KernelHost` is every member an arbiter uses of the kernels it schedules.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

from ..api.input import Claim
from ..api.views import Principal, ViewContext
from ..core import Lease
from ..devices.base import DeviceSnapshot

log = logging.getLogger("jupyter_gpusched")

#: The longest a claim call waits for a grant before answering 202 with a position.
MAX_WAIT = 30.0


class ArbiterError(Exception):
    """A request that cannot be served; ``status`` is the HTTP status, ``message`` for a person."""

    status = 400
    reason = "Bad Request"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


def _error(name: str, status: int, reason: str, doc: str) -> type[ArbiterError]:
    return type(name, (ArbiterError,), {"status": status, "reason": reason, "__doc__": doc, "__module__": __name__})


BadRequest = _error("BadRequest", 400, "Bad Request", "The request cannot be served as asked.")
Forbidden = _error("Forbidden", 403, "Forbidden", "The caller may not do this.")
NotFound = _error("NotFound", 404, "Not Found", "No such lease, kernel or GPU (for this caller).")
Conflict = _error("Conflict", 409, "Conflict", "The request conflicts with the lease's state.")
NoInventory = _error(
    "NoInventory", 503, "Service Unavailable", "No GPU can be scheduled here: no inventory, or every GPU drained or lost."
)
LedgerUnavailable = _error(
    "LedgerUnavailable", 503, "Service Unavailable", "The lease ledger could not be written (locked too long, unreadable)."
)


@dataclass(frozen=True)
class ClaimResult:
    """The lease after a claim, and whether it was granted now (201), waits (202) or existed (200)."""

    status: int
    lease: dict


@dataclass(frozen=True)
class ArbiterEvent:
    """Something changed. The websockets shape it for each viewer (:mod:`jupyter_gpusched.api.events`)."""

    type: str  # "lease" | "device" | "notice"
    lease: Lease | None = None
    device: DeviceSnapshot | None = None
    notice: Mapping[str, Any] | None = None
    #: The event already shaped for this server's user (hub mode: the broker shapes it).
    payload: Mapping[str, Any] | None = None


class KernelHost(Protocol):
    """The kernels an arbiter can see and act on: a Jupyter server's, or the broker's view of its servers'."""

    server_id: str

    def activity(self) -> Mapping[str, tuple[bool, float | None, float | None]]:
        """Kernel id -> (executing now, last moment it executed, when that execution began)."""

    def alive(self, kernel_id: str) -> bool | None:
        """Whether the kernel still exists here (None: not a kernel of this host)."""

    def executing(self, kernel_id: str) -> bool:
        """Whether the kernel runs a cell at this moment, as far as this host knows without asking
        anyone (the executor calls off a checkpoint that a cell has overtaken)."""
        ...

    def asking(self, kernel_id: str) -> None:
        """The kernel itself asks for a GPU (its token, from its own code): it runs a cell or a
        comm's handler now, even where the host did not see that begin."""

    def restarting(self, kernel_id: str) -> bool:
        """Whether the kernel is being restarted on purpose (its lease stays)."""

    def adopted(self, kernel_id: str) -> None:
        """The kernel's own process now owns its lease (a restart is over)."""

    def kernel_pid(self, kernel_id: str) -> int | None:
        """The kernel's main process."""

    def process_tree(self, kernel_id: str) -> set[int]:
        """The kernel's process and its descendants."""

    def process_trees(self) -> dict[str, set[int]]:
        """:meth:`process_tree` of every kernel, in one pass over the process table."""

    def notebook(self, kernel_id: str) -> str | None:
        """The notebook path of the kernel's session, where known."""

    async def refresh_notebooks(self) -> None:
        """Read the notebook of each kernel's session again (they can be renamed)."""

    def user_of(self, kernel_id: str) -> str | None:
        """The user a kernel belongs to, where this host knows it (None: unknown)."""

    async def restart(self, kernel_id: str) -> None: ...

    async def shutdown(self, kernel_id: str) -> None: ...


class Arbiter(abc.ABC):
    """What every front end of the scheduler talks to."""

    mode: str = "standalone"

    def __init__(self) -> None:
        self._listener_set: set[Callable[[ArbiterEvent], None]] = set()

    async def start(self) -> None:
        """Start background work."""

    async def stop(self) -> None:
        """Stop background work."""

    def close(self) -> None:
        """Let go of what the arbiter holds open (the GPU backend, the ledger), after :meth:`stop`."""

    # -- reads ----------------------------------------------------------------------------------
    @abc.abstractmethod
    async def status(self, who: Principal) -> dict: ...

    @abc.abstractmethod
    async def devices(self, who: Principal) -> list[dict]: ...

    @abc.abstractmethod
    async def leases(self, who: Principal, kernel_id: str | None = None) -> list[dict]: ...

    @abc.abstractmethod
    async def lease(self, who: Principal, lease_id: str) -> dict: ...

    @abc.abstractmethod
    async def lease_for_kernel(self, kernel_id: str) -> Lease | None:
        """The kernel's live lease (for the provisioner: is it suspended, which GPUs)."""

    @abc.abstractmethod
    def view_context(self) -> ViewContext:
        """What views need beyond the records, as of now (one per batch of events)."""

    @abc.abstractmethod
    def render_lease(self, lease: Lease, who: Principal, ctx: ViewContext | None = None) -> dict: ...

    @abc.abstractmethod
    def render_device(self, device: DeviceSnapshot, who: Principal, ctx: ViewContext | None = None) -> dict: ...

    # -- writes ---------------------------------------------------------------------------------
    @abc.abstractmethod
    async def claim(self, who: Principal, ask: Claim) -> ClaimResult:
        """Ask for GPUs for ``ask.kernel_id``; waits up to ``ask.wait`` seconds for the grant."""

    @abc.abstractmethod
    async def release(self, who: Principal, lease_id: str, memory_held: str = "release") -> dict | None:
        """Release a lease. Where its kernel's processes still hold GPU memory on its GPUs, the
        answer says so (``{released, lease, memory_held, processes, message}``): with
        ``memory_held="keep"`` the lease is then kept (``released`` false), with ``"release"``
        it is released all the same and that memory counts as taken. ``None``: released, and
        nothing was left behind."""

    @abc.abstractmethod
    async def keep(self, who: Principal, lease_id: str, seconds: float) -> dict: ...

    @abc.abstractmethod
    async def cache_freed(self, who: Principal, lease_id: str, frameworks: tuple[str, ...]) -> dict:
        """The kernel dropped its framework caches, as the ``free-cache`` step asked."""

    @abc.abstractmethod
    async def drain(self, who: Principal, uuid: str, drained: bool, reason: str = "") -> dict: ...

    @abc.abstractmethod
    async def kernel_started(self, kernel_id: str, user: str, pid: int | None) -> None: ...

    @abc.abstractmethod
    async def kernel_ended(self, kernel_id: str, reason: str) -> None: ...

    @abc.abstractmethod
    async def replan(self) -> Any:
        """A scheduling pass now (after a release, say), on what was last seen."""

    # -- events ---------------------------------------------------------------------------------
    def subscribe(self, listener: Callable[[ArbiterEvent], None]) -> None:
        self._listener_set.add(listener)

    def unsubscribe(self, listener: Callable[[ArbiterEvent], None]) -> None:
        self._listener_set.discard(listener)

    @property
    def listening(self) -> bool:
        """Whether anyone listens to this arbiter's events."""
        return bool(self._listener_set)

    def publish(self, event: ArbiterEvent) -> None:
        for listener in list(self._listener_set):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - one bad listener must not stop the others
                log.exception("event listener failed")


def notice(kind: str, lease: Lease, message: str) -> dict:
    """A notice event's body: what happened to ``lease``, for its user."""
    return {
        "kind": kind,
        "lease_id": lease.id,
        "kernel_id": lease.kernel_id,
        "user": lease.user,
        "message": message,
        "reclaim_at": lease.reclaim_at,
        "state": lease.state.value,
    }


def gpus_label(lease: Lease, snapshot: Iterable[DeviceSnapshot]) -> str:
    """``GPU 0 (name), GPU 1 (name)``: the lease's GPUs for a person."""
    index = {d.uuid: d for d in snapshot}
    names = [f"GPU {index[u].index} ({index[u].name})" if u in index else u for u in lease.devices]
    return ", ".join(names) or "no GPU"
