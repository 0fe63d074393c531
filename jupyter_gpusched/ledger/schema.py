"""The file's schema: one migration per version, and the tables each version has."""

from __future__ import annotations

import sqlite3
from typing import Callable

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "SQLITE_MAGIC", "TABLES", "schema_tables", "user_tables"]

SQLITE_MAGIC = b"SQLite format 3\x00"


def _v1(conn: sqlite3.Connection) -> None:
    """Leases and their history."""
    conn.execute(
        """CREATE TABLE leases (
            "id" TEXT PRIMARY KEY,
            "kernel_id" TEXT NOT NULL,
            "user" TEXT NOT NULL,
            "count" INTEGER NOT NULL,
            "memory" INTEGER,
            "mode" TEXT NOT NULL,
            "priority" INTEGER NOT NULL,
            "created_at" REAL NOT NULL,
            "groups" TEXT NOT NULL,
            "state" TEXT NOT NULL,
            "devices" TEXT NOT NULL,
            "queued_at" REAL NOT NULL,
            "granted_at" REAL,
            "last_active_at" REAL,
            "busy" INTEGER NOT NULL,
            "reclaim_at" REAL,
            "reclaim_step" TEXT,
            "keep_until" REAL,
            "home" TEXT NOT NULL,
            "memory_held" INTEGER,
            "tried_steps" TEXT NOT NULL,
            "gaps" TEXT NOT NULL,
            "released_at" REAL,
            "reason" TEXT NOT NULL,
            "version" INTEGER NOT NULL
        )"""
    )
    conn.execute("CREATE INDEX leases_state ON leases(state)")
    conn.execute("CREATE INDEX leases_kernel ON leases(kernel_id)")
    conn.execute(
        """CREATE TABLE events (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            kind TEXT NOT NULL,
            lease_id TEXT,
            kernel_id TEXT,
            devices TEXT NOT NULL DEFAULT '[]',
            reason TEXT NOT NULL DEFAULT ''
        )"""
    )


def _v2(conn: sqlite3.Connection) -> None:
    """Owners (liveness that survives pid reuse), drained devices, and a tamper-evident history."""
    conn.execute(
        """CREATE TABLE owners (
            lease_id TEXT PRIMARY KEY,
            kernel_id TEXT NOT NULL,
            server_id TEXT NOT NULL,
            pid INTEGER NOT NULL,
            create_time REAL NOT NULL,
            hostname TEXT NOT NULL,
            since REAL NOT NULL
        )"""
    )
    conn.execute(
        """CREATE TABLE devices (
            uuid TEXT PRIMARY KEY,
            drained INTEGER NOT NULL DEFAULT 0,
            reason TEXT NOT NULL DEFAULT '',
            updated_at REAL NOT NULL
        )"""
    )
    conn.execute("ALTER TABLE events ADD COLUMN pid INTEGER")
    conn.execute("CREATE INDEX events_lease ON events(lease_id)")
    # The audit is only worth something if nobody rewrites what happened.
    for action in ("UPDATE", "DELETE"):
        conn.execute(
            f"""CREATE TRIGGER events_no_{action.lower()} BEFORE {action} ON events
            BEGIN SELECT RAISE(ABORT, 'the events table is append-only'); END"""
        )


def _v3(conn: sqlite3.Connection) -> None:
    """Checkpoints taken: every suspended process is restored, whatever becomes of its lease."""
    conn.execute(
        """CREATE TABLE checkpoints (
            pid INTEGER NOT NULL,
            create_time REAL NOT NULL,
            lease_id TEXT NOT NULL,
            kernel_id TEXT NOT NULL,
            devices TEXT NOT NULL,
            memory INTEGER,
            taken_at REAL NOT NULL,
            PRIMARY KEY (pid, create_time)
        )"""
    )
    conn.execute("CREATE INDEX checkpoints_lease ON checkpoints(lease_id)")


def _v4(conn: sqlite3.Connection) -> None:
    """Retention: a released lease and its history may be pruned together, and nothing else may.

    The history stays append-only for every lease the ledger still has and for events about no
    lease (drains); the events of a lease may go only once the lease itself is gone, and only a
    released lease may go. Replaying what remains (:func:`.audit.check_history`) still ends where
    the leases table stands, because a released lease holds nothing and its history is removed
    whole.
    """
    # (state, released_at): live leases are read by state on every pass without touching the
    # released ones, and pruning finds the oldest released leases without a scan.
    conn.execute("DROP INDEX IF EXISTS leases_state")
    conn.execute("CREATE INDEX leases_state_released ON leases(state, released_at)")
    conn.execute("DROP TRIGGER IF EXISTS events_no_delete")
    conn.execute(
        """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
        WHEN OLD.lease_id IS NULL OR EXISTS (SELECT 1 FROM leases WHERE id = OLD.lease_id)
        BEGIN SELECT RAISE(ABORT, 'the events table is append-only (only a pruned lease''s history may go)'); END"""
    )
    # One row: how much was pruned, so that a shorter history is never mistaken for a complete one.
    conn.execute(
        """CREATE TABLE pruned (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            leases INTEGER NOT NULL,
            events INTEGER NOT NULL,
            last_released_at REAL NOT NULL,
            at REAL NOT NULL
        )"""
    )
    conn.execute(
        """CREATE TRIGGER leases_no_live_delete BEFORE DELETE ON leases WHEN OLD.state != 'released'
        BEGIN SELECT RAISE(ABORT, 'a live lease cannot be deleted, only released'); END"""
    )


def _v5(conn: sqlite3.Connection) -> None:
    """Schema 5: recent GPU usage per subject (``user:NAME``, ``group:NAME``) for fair share with
    memory, and when a shared lease was first seen holding more than its memory share.

    ``gpu_seconds`` is the usage decayed to ``as_of`` and ``held`` the GPUs' worth the subject
    holds since then (``core.usage.Accrued``), so that a restart forgets nothing.
    """
    conn.execute(
        """CREATE TABLE usage (
            subject TEXT PRIMARY KEY,
            gpu_seconds REAL NOT NULL,
            held REAL NOT NULL DEFAULT 0,
            as_of REAL NOT NULL
        )"""
    )
    conn.execute('ALTER TABLE leases ADD COLUMN "over_share_since" REAL')


#: ``MIGRATIONS[n]`` takes a file from schema ``n`` to ``n + 1``; a new file runs them all.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_v1, _v2, _v3, _v4, _v5)
SCHEMA_VERSION = len(MIGRATIONS)
TABLES = frozenset({"leases", "events", "owners", "devices", "checkpoints", "pruned", "usage"})


def user_tables(conn: sqlite3.Connection) -> set[str]:
    """The tables in a file, less those SQLite makes by itself."""
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return {n for n in names if not n.startswith("sqlite_")}


def schema_tables(version: int) -> frozenset[str]:
    """The tables a ledger of schema ``version`` has: its migrations run on an empty database."""
    if version not in _SCHEMA_TABLES:
        conn = sqlite3.connect(":memory:")
        try:
            for step in MIGRATIONS[:version]:
                step(conn)
            _SCHEMA_TABLES[version] = frozenset(user_tables(conn))
        finally:
            conn.close()
    return _SCHEMA_TABLES[version]


_SCHEMA_TABLES: dict[int, frozenset[str]] = {}
