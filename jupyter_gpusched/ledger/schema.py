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


#: ``MIGRATIONS[n]`` takes a file from schema ``n`` to ``n + 1``; a new file runs them all.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_v1, _v2, _v3)
SCHEMA_VERSION = len(MIGRATIONS)
TABLES = frozenset({"leases", "events", "owners", "devices", "checkpoints"})


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
