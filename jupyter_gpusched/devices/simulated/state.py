"""The state file: who holds what on the simulated GPUs, shared by every process on the host.

A small SQLite file (WAL mode) that the backend creates and kernels write their allocations to.
Every write that checks before it writes runs in one ``BEGIN IMMEDIATE`` transaction, so two
processes cannot both fit into the same free memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterator, Sequence

from ... import files, procs
from ...core.units import format_bytes, parse_memory
from ..base import DeviceLost
from .config import SimulatedDevice

__all__ = [
    "ALLOW_SHARED_SETTING",
    "SimulatedCudaError",
    "SimulatedOutOfMemory",
    "UnsafeStateFile",
    "as_bytes",
    "as_percent",
    "check_usable",
    "device_row",
    "drop_dead",
    "held_bytes",
    "init_state",
    "place",
    "transaction",
]

# The package's one logger, named as before the simulated backend became a package.
log = logging.getLogger("jupyter_gpusched.devices.simulated")

#: The setting that lets an admin share the state file with other users' kernels.
ALLOW_SHARED_SETTING = "c.GPUSchedApp.allow_shared_state_files (c.GPUBroker.allow_shared_state_files for the broker)"

_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    uuid TEXT PRIMARY KEY,
    idx INTEGER NOT NULL,
    name TEXT NOT NULL,
    memory_total INTEGER NOT NULL,
    parent_uuid TEXT,
    has_mig INTEGER NOT NULL DEFAULT 0,
    lost INTEGER NOT NULL DEFAULT 0,
    utilization REAL
);
CREATE TABLE IF NOT EXISTS processes (
    pid INTEGER NOT NULL,
    started REAL,
    uuid TEXT NOT NULL,
    memory INTEGER NOT NULL DEFAULT 0,
    utilization REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (pid, uuid)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    pid INTEGER NOT NULL,
    started REAL,
    uuid TEXT NOT NULL,
    memory INTEGER NOT NULL,
    utilization REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (pid, uuid)
);
CREATE TABLE IF NOT EXISTS faults (field TEXT PRIMARY KEY);
"""
_TABLES = frozenset({"devices", "processes", "checkpoints", "faults"})


class SimulatedCudaError(RuntimeError):
    """What CUDA would have refused, said plainly."""


class SimulatedOutOfMemory(SimulatedCudaError):
    """An allocation past the simulated GPU's memory."""



def _connect(path: str, create: bool) -> sqlite3.Connection:
    if create:
        conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    else:
        if os.path.islink(path):
            raise SimulatedCudaError(f"the simulated GPU state {path} is a symbolic link; it is not followed")
        if not os.path.exists(path):
            raise SimulatedCudaError(
                f"no simulated GPUs at {path}: start a jupyter-gpusched server with the simulated backend first"
            )
        uri = Path(os.path.abspath(path)).as_uri() + "?mode=rw"
        conn = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    return conn


@contextlib.contextmanager
def transaction(path: str, write: bool, create: bool = False) -> Iterator[sqlite3.Connection]:
    """One transaction; writers take the lock up front so read-check-write stays atomic."""
    conn = _connect(path, create)
    try:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    finally:
        conn.close()


class UnsafeStateFile(Exception):
    """The state file is not one the simulated backend may create or write."""


def _open_state(path: str, allow_shared: bool) -> None:
    """Create the state file (0600), or check the one there; refuse anything not ours.

    Raises:
        UnsafeStateFile: a link, another user's or a shared file (unless ``allow_shared``), or a
            SQLite file of another application; it was left untouched.
    """
    setting = "simulated_state_path"
    try:
        checked = files.prepare(path, setting=setting)
        if checked.header and checked.header != b"SQLite format 3\x00":
            raise files.UnsafeFile("is not a SQLite database", f"set {setting} to another file")
        files.check_private(checked, setting=setting, allow_shared=allow_shared, allow_setting=ALLOW_SHARED_SETTING)
        conn = _connect(path, create=True)
        try:
            files.confirm_same(checked)
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            tables = {n for n in names if not n.startswith("sqlite_")}
            if version not in (0, _SCHEMA_VERSION) or (version == 0 and tables) or tables - _TABLES:
                raise files.UnsafeFile(
                    "is a SQLite database of something else"
                    + (f" (it has tables {', '.join(sorted(tables - _TABLES))})" if tables - _TABLES else ""),
                    f"set {setting} to another file",
                )
            # WAL lets kernels write their allocations while the server reads a snapshot.
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()
    except files.UnsafeFile as exc:
        raise UnsafeStateFile(
            f"the simulated GPU state file {path} {exc.problem}. It was left untouched."
            + (f" {exc.advice}." if exc.advice else "")
        ) from None


def init_state(path: str, devices: Sequence[SimulatedDevice], allow_shared: bool = False) -> None:
    _open_state(path, allow_shared)
    parents = {d.parent_uuid for d in devices if d.parent_uuid}
    with transaction(path, write=True, create=True) as conn:
        # executescript would commit first; run the statements inside this transaction instead.
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        known = {row["uuid"] for row in conn.execute("SELECT uuid FROM devices")}
        wanted = {d.uuid for d in devices}
        stale = known - wanted
        if stale:
            log.warning("simulated GPU state %s described other GPUs; replacing %s", path, sorted(stale))
            conn.executemany("DELETE FROM devices WHERE uuid = ?", [(u,) for u in stale])
        for d in devices:
            # Keep faults scripted by another process that shares the file (lost, utilization).
            conn.execute(
                "INSERT INTO devices (uuid, idx, name, memory_total, parent_uuid, has_mig) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (uuid) DO UPDATE SET idx = excluded.idx, name = excluded.name,"
                " memory_total = excluded.memory_total, parent_uuid = excluded.parent_uuid,"
                " has_mig = excluded.has_mig",
                (d.uuid, d.index, d.name, d.memory_total, d.parent_uuid, int(d.uuid in parents)),
            )


def drop_dead(conn: sqlite3.Connection) -> set[int]:
    """Forget the GPU memory of processes that exited, as the driver does."""
    dead = {
        (row["pid"], row["started"])
        for row in conn.execute(
            "SELECT DISTINCT pid, started FROM processes UNION SELECT DISTINCT pid, started FROM checkpoints"
        )
        if not procs.alive(row["pid"], row["started"])
    }
    for pid, started in dead:
        # Matched on the start time too: a new process that reused the pid keeps its own memory.
        match = (pid, started)
        for row in conn.execute("SELECT uuid, memory FROM processes WHERE pid = ? AND started IS ?", match):
            log.info("simulated GPU %s: process %s exited; %s freed", row["uuid"], pid, format_bytes(row["memory"]))
        conn.execute("DELETE FROM processes WHERE pid = ? AND started IS ?", match)
        conn.execute("DELETE FROM checkpoints WHERE pid = ? AND started IS ?", match)
    return {pid for pid, _ in dead}


def device_row(conn: sqlite3.Connection, uuid: str) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM devices WHERE uuid = ?", (uuid,)).fetchone()
    if row is None:
        raise SimulatedCudaError(f"{uuid} is not a simulated GPU on this host")
    return row


def check_usable(conn: sqlite3.Connection, row: sqlite3.Row) -> None:
    lost = bool(row["lost"])
    if row["parent_uuid"] and not lost:
        lost = bool(device_row(conn, row["parent_uuid"])["lost"])
    if lost:
        raise DeviceLost(f"simulated GPU {row['uuid']} is lost (fell off the bus)", uuid=row["uuid"])
    if row["has_mig"]:
        raise SimulatedCudaError(
            f"simulated GPU {row['uuid']} is in MIG mode: CUDA runs on its MIG instances, not on the GPU itself"
        )


def held_bytes(conn: sqlite3.Connection, table: str, **match: Any) -> int:
    """Bytes in ``processes`` or ``checkpoints`` rows matching ``match`` (column = value)."""
    where = " AND ".join(f"{column} = ?" for column in match)
    query = f"SELECT COALESCE(SUM(memory), 0) FROM {table} WHERE {where}"
    return int(conn.execute(query, tuple(match.values())).fetchone()[0])


def place(
    conn: sqlite3.Connection, uuid: str, pid: int, started: float | None, nbytes: int, utilization: float | None
) -> None:
    """Add ``nbytes`` for ``pid`` on ``uuid``, refusing what would not fit (the OOM check)."""
    row = device_row(conn, uuid)
    check_usable(conn, row)
    used = held_bytes(conn, "processes", uuid=uuid)
    if used + nbytes > row["memory_total"]:
        mine = held_bytes(conn, "processes", uuid=uuid, pid=pid)
        raise SimulatedOutOfMemory(
            f"CUDA out of memory (simulated): tried to allocate {format_bytes(nbytes)} on {uuid}, which has "
            f"{format_bytes(row['memory_total'])} in all, {format_bytes(used)} in use "
            f"({format_bytes(mine)} by process {pid}) and {format_bytes(row['memory_total'] - used)} free"
        )
    conn.execute(
        "INSERT INTO processes (pid, started, uuid, memory, utilization) VALUES (?, ?, ?, ?, COALESCE(?, 0))"
        " ON CONFLICT (pid, uuid) DO UPDATE SET memory = memory + excluded.memory,"
        " utilization = COALESCE(?, utilization)",
        (pid, started, uuid, nbytes, utilization, utilization),
    )


def as_percent(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise ValueError(f"{what} must be a percentage between 0 and 100, not {value!r}")
    return float(value)


def as_bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({value})")
        return value
    size = parse_memory(value, "nbytes")
    if size is None:
        raise ValueError("nbytes must be a size such as '16GiB' or a number of bytes")
    return size
