"""The kernel's lease as last read, and what this kernel did to it: one place, one lock.

The shell thread (the pre-run hook, the magics, the claim loop) and the watcher thread both read
and write the lease; every read and write goes through :class:`LeaseCache`, under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import render
from .client import GPUSchedError
from .states import HOLDING, LIVE, LeaseState

if TYPE_CHECKING:
    from .client import Client


@dataclass(frozen=True)
class LeaseView:
    """One consistent reading of the cache (the lease is a copy)."""

    #: The last known lease of this kernel (``None``: none known).
    lease: dict | None
    #: When it was read (the cache's clock; ``-inf``: never).
    read_at: float
    #: Whether this kernel has held a GPU since it started.
    had_lease: bool
    #: Ids of leases this kernel released or withdrew itself.
    released_by_me: frozenset[str]
    #: Whether the user released the lease (the kernel then asks for none by itself).
    user_released: bool
    #: The last claim made (``count``, ``memory``, ``mode``, ``priority``): made again when the
    #: lease is taken back.
    last_claim: dict | None = None


class LeaseCache:
    """The last known lease, when it was read, and the kernel's own doings with it.

    Args:
        clock: wall-clock seconds, for when a lease was read.
    """

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._lock = threading.RLock()
        self._lease: dict | None = None
        self._read_at = float("-inf")
        self._had_lease = False
        self._released_by_me: set[str] = set()
        self._user_released = False
        self._last_claim: dict | None = None
        self._claiming = False

    @property
    def lease(self) -> dict | None:
        """A copy of the last known lease."""
        with self._lock:
            return dict(self._lease) if self._lease else None

    def view(self) -> LeaseView:
        """Everything at once, read under the lock."""
        with self._lock:
            return LeaseView(
                lease=dict(self._lease) if self._lease else None,
                read_at=self._read_at,
                had_lease=self._had_lease,
                released_by_me=frozenset(self._released_by_me),
                user_released=self._user_released,
                last_claim=dict(self._last_claim) if self._last_claim else None,
            )

    def set(self, lease: dict | None, *, read_at: float | None = None) -> None:
        """Take ``lease`` as the current reading (read now unless ``read_at`` says when)."""
        with self._lock:
            self._store(lease, read_at)

    def replace(self, pick: Callable[[dict | None], dict | None]) -> tuple[dict | None, dict | None]:
        """Replace the lease with ``pick(previous)`` in one step; returns ``(previous, new)``."""
        with self._lock:
            previous = dict(self._lease) if self._lease else None
            self._store(pick(previous), None)
            return previous, self.lease

    def _store(self, lease: dict | None, read_at: float | None) -> None:
        self._lease = dict(lease) if lease else None
        self._read_at = self._clock() if read_at is None else read_at
        if lease and lease.get("state") in HOLDING:
            self._had_lease = True

    def mark_withdrawn(self, ids: Iterable[str]) -> None:
        """The cached lease, if among ``ids``, was withdrawn by the user (its time stays)."""
        with self._lock:
            if self._lease and self._lease.get("id") in set(ids):
                self._lease = {**self._lease, "state": LeaseState.RELEASED.value, "reason": "withdrawn by the user"}

    def note_released(self, lease_id: Any) -> None:
        """This kernel released (or withdrew) the lease ``lease_id`` itself."""
        with self._lock:
            self._released_by_me.add(lease_id)

    @property
    def user_released(self) -> bool:
        with self._lock:
            return self._user_released

    @user_released.setter
    def user_released(self, value: bool) -> None:
        with self._lock:
            self._user_released = bool(value)

    @property
    def had_lease(self) -> bool:
        with self._lock:
            return self._had_lease

    @property
    def last_claim(self) -> dict | None:
        """The last claim made (the pre-run hook makes it again when the lease is taken back)."""
        with self._lock:
            return dict(self._last_claim) if self._last_claim else None

    @last_claim.setter
    def last_claim(self, params: Mapping[str, Any] | None) -> None:
        with self._lock:
            self._last_claim = dict(params) if params else None

    @property
    def claiming(self) -> bool:
        """True while the claim loop runs: it reads the lease itself, so the watcher stays quiet."""
        with self._lock:
            return self._claiming

    @claiming.setter
    def claiming(self, value: bool) -> None:
        with self._lock:
            self._claiming = bool(value)


class LeaseReader:
    """Reads this kernel's lease from the server into the cache, and reports what changed.

    Args:
        client: the REST client (found on first use; raises NoServerError where there is none).
        leases: the cache it reads into.
        report: told ``(previous, current)`` after each read (the watcher shows the notices).
        connected: whether talking to the server is expected (without discovering it now).
        max_age: seconds a cached lease is taken as fresh before a cell.
        clock: wall-clock seconds.
    """

    def __init__(
        self,
        *,
        client: Callable[[], Client],
        leases: LeaseCache,
        report: Callable[[dict | None, dict | None], None],
        connected: Callable[[], bool],
        max_age: Callable[[], float],
        clock: Callable[[], float],
    ):
        self._client = client
        self._leases = leases
        self._report = report
        self._connected = connected
        self._max_age = max_age
        self._clock = clock

    def refresh(self) -> dict | None:
        """Read this kernel's lease from the server (``GET api/gpusched/leases?kernel_id=``)."""
        client = self._client()
        kid = client.kernel_id
        leases = client.leases(kid)
        known = self._leases.lease
        if (
            known is not None
            and known.get("state") in LIVE
            and render.my_lease(leases, kid) is None
            and not any(le.get("id") == known.get("id") for le in leases)
        ):
            # A lease that ended is no longer listed: read it, so that the notice says why it
            # ended (taken back while idle, released from the sidebar) instead of guessing.
            try:
                leases = [*leases, client.lease(str(known.get("id")))]
            except GPUSchedError:
                pass
        previous, lease = self._leases.replace(lambda previous: pick(leases, previous, kid))
        # Whoever reads the lease first (the watcher, the hook, a magic) reports what changed.
        self._report(previous, lease)
        return self._leases.lease

    def current(self) -> dict | None:
        """The lease as the pre-run hook needs it: read fresh while it holds a GPU.

        A lease that held a GPU a moment ago may have been checkpointed since: a cell must not
        touch CUDA before its state is restored (on a real GPU, a CUDA call from a checkpointed
        process can crash it), so a holding lease is never taken from the cache.
        """
        view = self._leases.view()
        lease, age = view.lease, self._clock() - view.read_at
        if not self._connected():
            return lease
        state = lease.get("state") if lease else None
        fresh = age <= self._max_age()
        if lease is None and fresh:
            return None
        if state == LeaseState.SUSPENDED or (state == LeaseState.RELEASED and fresh):
            return lease
        return self.refresh()


def pick(leases: list[dict], previous: dict | None, kid: str | None) -> dict | None:
    """This kernel's lease in a list from the server; a vanished known lease is released."""
    mine = render.my_lease(leases, kid)
    if mine is not None:
        return mine
    if previous is not None:
        for lease in leases:
            if lease.get("id") == previous.get("id"):
                return dict(lease)
        if previous.get("state") in LIVE:
            return {
                **previous,
                "state": LeaseState.RELEASED.value,
                "devices": [],
                "reason": "the server no longer lists this lease",
            }
        return previous
    return None
