"""The lease ledger: SQLite persistence shared by every process that schedules GPUs on a host.

One file holds the leases, who owns each of them, an append-only history of what happened to
them, and the devices an admin drained. Several Jupyter servers of one user (standalone mode) or
the hub broker point at the same file; a write transaction is ``BEGIN IMMEDIATE`` in WAL mode, so
writers take turns and a reader never blocks a writer. Run the scheduling pass inside one
transaction and no device can be granted twice::

    with ledger.transaction() as tx:
        result = core.plan(devices, tx.leases(), activity, tx.now, cfg)
        for lease_id in result.changed:
            tx.put(result.lease(lease_id))

Threads: a :class:`Ledger` keeps one SQLite connection, guarded by a lock. Threads of a process
share it and take turns (a transaction holds the lock until it ends); the transactions are short
and SQLite lets only one writer in at a time anyway. A thread that must read while another one
writes can open a second :class:`Ledger` on the same file. A ledger inherited across ``fork``
opens a fresh connection in the child on first use, because an SQLite connection must not cross a
fork.

The history is written by :meth:`Transaction.put` itself whenever a lease gains or loses devices
(``claim``, ``grant``, ``restore``, ``suspend``, ``release``), so that the audit in
:meth:`Ledger.check` cannot miss a grant a caller forgot to record; :meth:`Transaction.record`
adds the rest (reclaim decisions, notices, admin actions).

Retention: :meth:`Ledger.prune` deletes the oldest released leases with their history and
owners, a batch per short transaction, so that the file stops growing; live leases are never
pruned, and :meth:`Ledger.check` holds over what remains; :meth:`Ledger.pruned` says what went.

A file this code cannot use (not SQLite, corrupt, unreadable, or written by a newer version) is
never modified: :class:`LedgerError` says which file and what to do.

The package, one module per concern: :mod:`.schema` (tables and migrations), :mod:`.rows`
(records and how they are stored), :mod:`.audit` (the history and its checks),
:mod:`.transaction` and :mod:`.store` (the :class:`Ledger` itself).
"""

from __future__ import annotations

from ..procs import START_TIME_TOLERANCE, OwnerId, is_alive
from .audit import ACQUIRE_KINDS, CLAIM, FREE_KINDS, GRANT, RELEASE, RESTORE, SUSPEND
from .errors import LedgerBusy, LedgerConflict, LedgerError, LedgerWouldBlock
from .rows import LEASE_COLUMNS, Checkpoint, Event, Owner, Pruned
from .schema import MIGRATIONS, SCHEMA_VERSION
from .store import ALLOW_SHARED_SETTING, Ledger
from .transaction import Transaction

__all__ = [
    "ACQUIRE_KINDS",
    "ALLOW_SHARED_SETTING",
    "CLAIM",
    "FREE_KINDS",
    "GRANT",
    "LEASE_COLUMNS",
    "MIGRATIONS",
    "RELEASE",
    "RESTORE",
    "SCHEMA_VERSION",
    "START_TIME_TOLERANCE",
    "SUSPEND",
    "Checkpoint",
    "Event",
    "Ledger",
    "LedgerBusy",
    "LedgerWouldBlock",
    "LedgerConflict",
    "LedgerError",
    "Owner",
    "OwnerId",
    "Pruned",
    "Transaction",
    "is_alive",
]
