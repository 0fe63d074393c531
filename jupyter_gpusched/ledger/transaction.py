"""One write transaction on the ledger: leases, their history, owners, checkpoints, drains."""

from __future__ import annotations

import logging
import os
import sqlite3
from typing import Iterable, Mapping

from ..core import Lease, LeaseState
from ..procs import OwnerId
from .audit import transition_events
from .errors import LedgerConflict, LedgerError
from .rows import (
    COLUMN_LIST,
    LEASE_COLUMNS,
    Checkpoint,
    Event,
    Owner,
    dump,
    select_checkpoints,
    select_drained,
    select_lease,
    select_leases,
    select_owners,
    select_usage,
    to_row,
)
from ..core.usage import Accrued

__all__ = ["Transaction"]

# The package's one logger, named as before the ledger became a package.
log = logging.getLogger("jupyter_gpusched.ledger")

_MARKS = ", ".join("?" for _ in LEASE_COLUMNS)
_UPDATES = ", ".join(f'"{c}" = excluded."{c}"' for c in LEASE_COLUMNS if c != "id")
#: Insert a lease or update every column of it (one statement, made once).
_UPSERT = f"INSERT INTO leases ({COLUMN_LIST}) VALUES ({_MARKS}) ON CONFLICT(id) DO UPDATE SET {_UPDATES}"


class Transaction:
    """One write transaction; get it from :meth:`Ledger.transaction`.

    ``now`` is the time of the transaction, taken once the write lock is held (or passed in),
    and is the time of every history line it writes.
    """

    def __init__(self, conn: sqlite3.Connection, now: float) -> None:
        self._conn = conn
        self.now = now
        self._open = True

    def _c(self) -> sqlite3.Connection:
        if not self._open:
            raise LedgerError("this ledger transaction is over; start a new one")
        return self._conn

    # leases
    def leases(self, live_only: bool = True) -> list[Lease]:
        """The leases, oldest first; released ones too unless ``live_only``."""
        return select_leases(self._c(), live_only)

    def lease(self, lease_id: str) -> Lease | None:
        """One lease, or ``None`` if the ledger has no such lease."""
        return select_lease(self._c(), lease_id)

    def put(self, lease: Lease, before: Lease | None | object = ...) -> Lease | None:
        """Insert or update ``lease``; return the record it replaced.

        Writing a lease whose ``version`` is not above the stored one raises
        :class:`LedgerConflict` (it was computed from a stale read), unless the two records are
        identical, which writes nothing. Device changes are added to the history.
        """
        conn = self._c()
        if before is ...:
            before = select_lease(conn, lease.id)
        assert before is None or isinstance(before, Lease)
        if before == lease:
            return before
        if before is not None and lease.version <= before.version:
            raise LedgerConflict(
                f"lease {lease.id} changed since it was read (stored version {before.version}, "
                f"this write version {lease.version}); read it again and retry"
            )
        conn.execute(
            _UPSERT,
            to_row(lease),
        )
        for event in transition_events(before, lease, self.now):
            self.record(event)
        if before is None or before.state != lease.state:
            log.debug(
                "lease %s of kernel %s: %s -> %s (v%s): %s",
                lease.id,
                lease.kernel_id,
                before.state.value if before else "new",
                lease.state.value,
                lease.version,
                lease.reason,
            )
        return before

    def prune(self, older_than: float, batch: int = 500) -> int:
        """Delete at most ``batch`` leases released before ``older_than``, with all that is theirs.

        The oldest go first. A lease goes with its history, its owner row and nothing else; a
        lease with a checkpoint not restored yet stays until the checkpoint is dropped, and a live
        lease is never touched (the schema refuses to delete one). The ``pruned`` row adds up what
        went (:meth:`Ledger.pruned`). Returns how many leases were deleted.

        Args:
            older_than: seconds since the epoch; a lease released at this time or later stays.
            batch: the most leases deleted by this call (at least 1).
        """
        if batch < 1:
            raise ValueError(f"batch must be 1 or more leases, not {batch!r}")
        conn = self._c()
        rows = list(
            conn.execute(
                """SELECT id, released_at FROM leases WHERE state = ? AND released_at < ?
                   AND NOT EXISTS (SELECT 1 FROM checkpoints AS c WHERE c.lease_id = leases.id)
                   ORDER BY released_at LIMIT ?""",
                (LeaseState.RELEASED.value, float(older_than), int(batch)),
            )
        )
        if not rows:
            return 0
        ids = [(lease_id,) for lease_id, _ in rows]
        # The leases first: the schema lets a lease's events go only once the lease is gone.
        conn.executemany("DELETE FROM leases WHERE id = ?", ids)
        events = conn.executemany("DELETE FROM events WHERE lease_id = ?", ids).rowcount
        conn.executemany("DELETE FROM owners WHERE lease_id = ?", ids)
        conn.execute(
            """INSERT INTO pruned (id, leases, events, last_released_at, at) VALUES (1, ?, ?, ?, ?)
               ON CONFLICT(id) DO UPDATE SET leases = leases + excluded.leases, events = events + excluded.events,
                 last_released_at = max(last_released_at, excluded.last_released_at), at = excluded.at""",
            (len(ids), events, rows[-1][1], self.now),
        )
        log.debug("GPU ledger: pruned %d released leases and their %d events", len(ids), events)
        return len(ids)

    # history
    def record(self, event: Event) -> int:
        """Append ``event`` to the history; return its sequence number."""
        cur = self._c().execute(
            "INSERT INTO events (at, kind, lease_id, kernel_id, devices, reason, pid) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                float(event.at),
                event.kind,
                event.lease_id,
                event.kernel_id,
                dump(event.devices),
                event.reason,
                event.pid if event.pid is not None else os.getpid(),
            ),
        )
        return int(cur.lastrowid)

    # owners
    def set_owner(
        self, lease_id: str, kernel_id: str, server_id: str = "", process: OwnerId | None = None
    ) -> Owner:
        """Record who holds ``lease_id`` (``process`` defaults to this one)."""
        owner = Owner(lease_id, kernel_id, server_id, process or OwnerId.current(), self.now)
        p = owner.process
        self._c().execute(
            """INSERT INTO owners (lease_id, kernel_id, server_id, pid, create_time, hostname, since)
               VALUES (?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT(lease_id) DO UPDATE SET kernel_id = excluded.kernel_id,
                 server_id = excluded.server_id, pid = excluded.pid,
                 create_time = excluded.create_time, hostname = excluded.hostname, since = excluded.since""",
            (lease_id, kernel_id, server_id, p.pid, p.create_time, p.hostname, owner.since),
        )
        log.debug("lease %s of kernel %s: owned by pid %s on %s", lease_id, kernel_id, p.pid, p.hostname)
        return owner

    def owners(self, live_only: bool = True) -> dict[str, Owner]:
        """Owner of each live lease that has one, by lease id; of released ones too unless ``live_only``."""
        return select_owners(self._c(), live_only)

    # checkpoints
    def add_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Record a process whose GPU state was just checkpointed."""
        c = checkpoint
        self._c().execute(
            """INSERT OR REPLACE INTO checkpoints (pid, create_time, lease_id, kernel_id, devices, memory, taken_at)
               VALUES (?, ?, ?, ?, ?, ?, ?)""",
            (c.pid, c.create_time, c.lease_id, c.kernel_id, dump(c.devices), c.memory, c.taken_at),
        )

    def checkpoints(self, lease_id: str | None = None) -> list[Checkpoint]:
        """Checkpointed processes not restored yet, of one lease or all."""
        return select_checkpoints(self._c(), lease_id)

    def drop_checkpoint(self, pid: int, create_time: float) -> None:
        """The process was restored (or is gone): forget its checkpoint."""
        self._c().execute("DELETE FROM checkpoints WHERE pid = ? AND create_time = ?", (pid, create_time))

    # recent usage
    def usage(self) -> dict[str, Accrued]:
        """Each subject's recent usage record (``core.usage``), by subject."""
        return select_usage(self._c())

    def write_usage(self, written: Mapping[str, Accrued], forgotten: Iterable[str] = ()) -> None:
        """Write the usage records ``written`` and delete those of the subjects ``forgotten``."""
        conn = self._c()
        gone = [(s,) for s in forgotten]
        if gone:
            conn.executemany("DELETE FROM usage WHERE subject = ?", gone)
        if written:
            conn.executemany(
                """INSERT INTO usage (subject, gpu_seconds, held, as_of) VALUES (?, ?, ?, ?)
                   ON CONFLICT(subject) DO UPDATE SET gpu_seconds = excluded.gpu_seconds,
                     held = excluded.held, as_of = excluded.as_of""",
                [(s, r.gpu_seconds, r.held, r.as_of) for s, r in written.items()],
            )

    # devices
    def drained(self) -> dict[str, str]:
        """Drained devices: uuid -> the admin's reason."""
        return select_drained(self._c())

    def set_drained(self, uuid: str, drained: bool, reason: str = "") -> None:
        """Drain a device (no new grants on it) or put it back into service."""
        conn = self._c()
        was = uuid in select_drained(conn)
        conn.execute(
            """INSERT INTO devices (uuid, drained, reason, updated_at) VALUES (?, ?, ?, ?)
               ON CONFLICT(uuid) DO UPDATE SET drained = excluded.drained, reason = excluded.reason,
                 updated_at = excluded.updated_at""",
            (uuid, int(drained), reason if drained else "", self.now),
        )
        if was != drained:
            self.record(Event("drain" if drained else "undrain", self.now, devices=(uuid,), reason=reason))
            state = "drained" if drained else "back in service"
            log.info("device %s %s%s", uuid, state, f": {reason}" if reason else "")
