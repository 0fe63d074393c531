"""The kernel's lease as last read, and what this kernel did to it: one place, one lock.

The shell thread (the pre-run hook, the magics, the claim loop) and the watcher thread both read
and write the lease; every read and write goes through :class:`LeaseCache`, under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .states import HOLDING, LeaseState


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
