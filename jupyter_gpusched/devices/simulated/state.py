"""The state file: who holds what on the simulated GPUs, shared by every process on the host.

A small SQLite file (WAL mode) that the backend creates and kernels write their allocations to.
Every write that checks before it writes runs in one ``BEGIN IMMEDIATE`` transaction, so two
processes cannot both fit into the same free memory.

A process is recorded as it knows itself: its pid in its own PID namespace, that namespace
(``ns``, the inode of ``/proc/<pid>/ns/pid``; 0 where the system has none) and its start time.
Readers map it to the pid they see (the backend: the host pid, as NVML reports it) with
:class:`~jupyter_gpusched.procs.PidNamespaces`; see :class:`Processes`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from ... import files, procs
from ...core.units import format_bytes, parse_memory
from ..base import DeviceLost
from .config import SimulatedDevice

__all__ = [
    "ALLOW_SHARED_SETTING",
    "Processes",
    "SimulatedCheckpointUnsupported",
    "SimulatedCudaError",
    "SimulatedLockTimeout",
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

_SCHEMA_VERSION = 2
_PROCESS_TABLES = ("processes", "checkpoints")
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
    ns INTEGER NOT NULL DEFAULT 0,
    started REAL,
    uuid TEXT NOT NULL,
    memory INTEGER NOT NULL DEFAULT 0,
    utilization REAL NOT NULL DEFAULT 0,
    work_until REAL,
    PRIMARY KEY (pid, ns, uuid)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    pid INTEGER NOT NULL,
    ns INTEGER NOT NULL DEFAULT 0,
    started REAL,
    uuid TEXT NOT NULL,
    memory INTEGER NOT NULL,
    utilization REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (pid, ns, uuid)
);
CREATE TABLE IF NOT EXISTS faults (field TEXT PRIMARY KEY);
"""
_TABLES = frozenset({"devices", "processes", "checkpoints", "faults"})


class SimulatedCudaError(RuntimeError):
    """What CUDA would have refused, said plainly."""


class SimulatedOutOfMemory(SimulatedCudaError):
    """An allocation past the simulated GPU's memory."""


class SimulatedLockTimeout(SimulatedCudaError):
    """A checkpoint's lock gave up: the process's GPU work outlasted the lock's timeout."""


class SimulatedCheckpointUnsupported(SimulatedCudaError):
    """A checkpoint the driver refuses whatever the process does: its GPU ``uuids`` are MIG instances."""

    def __init__(self, message: str, uuids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.uuids = tuple(uuids)



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
            if version not in (0, 1, _SCHEMA_VERSION) or (version == 0 and tables) or tables - _TABLES:
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
        if conn.execute("PRAGMA user_version").fetchone()[0] == 1:
            _migrate_from_1(conn)
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        # ``work_until`` (GPU work in flight, launch()) came later within schema 2: older readers
        # name their columns, so a column added here changes nothing for them.
        if "work_until" not in {row["name"] for row in conn.execute("PRAGMA table_info(processes)")}:
            conn.execute("ALTER TABLE processes ADD COLUMN work_until REAL")
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


def _migrate_from_1(conn: sqlite3.Connection) -> None:
    """Schema 1 named processes by pid alone, as the backend's PID namespace saw them."""
    own = procs.own_pid_namespace()
    for table in _PROCESS_TABLES:
        conn.execute(f"ALTER TABLE {table} RENAME TO {table}_v1")
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    for table in _PROCESS_TABLES:
        conn.execute(
            f"INSERT INTO {table} (pid, ns, started, uuid, memory, utilization)"
            f" SELECT pid, ?, started, uuid, memory, utilization FROM {table}_v1",
            (own,),
        )
        conn.execute(f"DROP TABLE {table}_v1")
    log.info("simulated GPU state: processes now recorded with their PID namespace (schema 2)")


class Processes:
    """Processes recorded in the state file, seen from this process's PID namespace.

    A row names a process as it knows itself (pid in its own namespace, the namespace); this
    maps it to the pid this process sees, and says whether it still runs: a row of a namespace
    this process cannot see (it runs outside the host's PID namespace, and the namespace is not
    one of its own descendants) cannot be judged, and is left alone.
    """

    def __init__(self, namespaces: procs.PidNamespaces | None = None, *, warn: bool = True) -> None:
        self.namespaces = namespaces or procs.PidNamespaces()
        #: Whether rows that cannot be judged are worth a warning (the backend's log), or only a
        #: debug line (a kernel, where a warning would land in the user's notebook).
        self.warn = warn
        self._warned: set[int] = set()

    @property
    def own(self) -> int:
        return self.namespaces.own

    def mine(self, ns: int) -> bool:
        """Whether namespace ``ns`` of a row is this process's (0: recorded without namespaces)."""
        return ns == 0 or ns == self.own

    def identity(self, pid: int) -> tuple[int, int]:
        """How the process this process sees as ``pid`` is recorded: (its pid there, its namespace).

        A process that does not run (or whose namespace cannot be read) is taken to be of this
        process's own namespace.
        """
        try:
            ns, inner = procs.namespace_pid(pid)
        except (ProcessLookupError, procs.PidNamespaceError):
            return pid, self.own
        return (pid, ns) if ns == self.own else (inner, ns)

    def local_pids(self, rows: Iterable[tuple[int, int]]) -> dict[tuple[int, int], int | None]:
        """The pid this process sees for each (pid, ns) row: None if it no longer runs.

        Rows that cannot be judged are left out (and logged once per namespace).
        """
        out: dict[tuple[int, int], int | None] = {}
        by_ns: dict[int, set[int]] = {}
        for pid, ns in rows:
            if self.mine(ns):
                out[(pid, ns)] = pid
            else:
                by_ns.setdefault(ns, set()).add(pid)
        for ns, pids in by_ns.items():
            try:
                found = self.namespaces.host_pids(ns, pids)
            except procs.PidNamespaceError as exc:
                if ns not in self._warned:
                    self._warned.add(ns)
                    log.log(
                        logging.WARNING if self.warn else logging.DEBUG,
                        "simulated GPUs: processes of PID namespace %s cannot be judged, left alone: %s", ns, exc,
                    )
                continue
            out.update(((pid, ns), found.get(pid)) for pid in pids)
        return out

    def running(self, rows: Iterable[tuple[int, int, float | None]]) -> dict[tuple[int, int, float | None], int | None]:
        """The pid this process sees for each (pid, ns, started) row whose process runs; None for
        one that has exited (or whose pid another process took). Rows that cannot be judged are
        left out."""
        rows = list(rows)
        local = self.local_pids((pid, ns) for pid, ns, _ in rows)
        out: dict[tuple[int, int, float | None], int | None] = {}
        for pid, ns, started in rows:
            if (pid, ns) in local:
                host = local[(pid, ns)]
                out[(pid, ns, started)] = host if host is not None and procs.alive(host, started) else None
        return out


def drop_dead(conn: sqlite3.Connection, processes: Processes) -> set[tuple[int, int]]:
    """Forget the GPU memory of processes that exited, as the driver does; returns their (pid, ns).

    Processes whose fate ``processes`` cannot tell (another PID namespace it does not see) stay.
    """
    rows = [
        (row["pid"], row["ns"], row["started"])
        for row in conn.execute(
            "SELECT DISTINCT pid, ns, started FROM processes UNION SELECT DISTINCT pid, ns, started FROM checkpoints"
        )
    ]
    dead = [row for row, host in processes.running(rows).items() if host is None]
    for pid, ns, started in dead:
        # Matched on the start time too: a new process that reused the pid keeps its own memory.
        match = (pid, ns, started)
        where = "pid = ? AND ns = ? AND started IS ?"
        for row in conn.execute(f"SELECT uuid, memory FROM processes WHERE {where}", match):
            log.info("simulated GPU %s: process %s exited; %s freed", row["uuid"], pid, format_bytes(row["memory"]))
        conn.execute(f"DELETE FROM processes WHERE {where}", match)
        conn.execute(f"DELETE FROM checkpoints WHERE {where}", match)
    return {(pid, ns) for pid, ns, _ in dead}


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
    conn: sqlite3.Connection,
    uuid: str,
    pid: int,
    started: float | None,
    nbytes: int,
    utilization: float | None,
    ns: int = 0,
) -> None:
    """Add ``nbytes`` for process ``pid`` of namespace ``ns`` on ``uuid``, refusing what would not fit."""
    row = device_row(conn, uuid)
    check_usable(conn, row)
    used = held_bytes(conn, "processes", uuid=uuid)
    if used + nbytes > row["memory_total"]:
        mine = held_bytes(conn, "processes", uuid=uuid, pid=pid, ns=ns)
        raise SimulatedOutOfMemory(
            f"CUDA out of memory (simulated): tried to allocate {format_bytes(nbytes)} on {uuid}, which has "
            f"{format_bytes(row['memory_total'])} in all, {format_bytes(used)} in use "
            f"({format_bytes(mine)} by process {pid}) and {format_bytes(row['memory_total'] - used)} free"
        )
    conn.execute(
        "INSERT INTO processes (pid, ns, started, uuid, memory, utilization) VALUES (?, ?, ?, ?, ?, COALESCE(?, 0))"
        " ON CONFLICT (pid, ns, uuid) DO UPDATE SET memory = memory + excluded.memory,"
        " utilization = COALESCE(?, utilization)",
        (pid, ns, started, uuid, nbytes, utilization, utilization),
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
