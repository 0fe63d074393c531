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

A file this code cannot use (not SQLite, corrupt, unreadable, or written by a newer version) is
never modified: :class:`LedgerError` says which file and what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import psutil

from . import files
from .core import EXCLUSIVE, Device, Lease, LeaseState, Step, released
from .core.model import LIVE

log = logging.getLogger(__name__)

__all__ = [
    "SCHEMA_VERSION",
    "Checkpoint",
    "Event",
    "Ledger",
    "LedgerBusy",
    "LedgerConflict",
    "LedgerError",
    "Owner",
    "OwnerId",
    "Transaction",
    "is_alive",
]

#: Event kinds that :meth:`Transaction.put` writes.
CLAIM = "claim"
GRANT = "grant"
RESTORE = "restore"
SUSPEND = "suspend"
RELEASE = "release"
#: Event kinds that give a lease devices, and those that take them away.
ACQUIRE_KINDS = frozenset({GRANT, RESTORE})
FREE_KINDS = frozenset({SUSPEND, RELEASE})

_SQLITE_MAGIC = b"SQLite format 3\x00"
#: The setting that lets an admin share the ledger with other users on purpose.
ALLOW_SHARED_SETTING = "c.GPUSchedApp.allow_shared_state_files (c.GPUBroker.allow_shared_state_files for the broker)"
#: Two start times closer than this are one process: /proc/stat's boot time can move by a second.
START_TIME_TOLERANCE = 1.0


class LedgerError(RuntimeError):
    """The ledger cannot be used; the message names the file and says what to do."""


class LedgerBusy(LedgerError):
    """Another process held the ledger's write lock for longer than the busy timeout."""


class LedgerConflict(LedgerError):
    """A lease was written from a stale read: someone else changed it in between."""


# -- owners ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OwnerId:
    """A process, identified so that a reused pid is not mistaken for it.

    ``create_time`` is the process start time as psutil reports it (seconds since the epoch).
    """

    pid: int
    create_time: float
    hostname: str

    @classmethod
    def current(cls) -> OwnerId:
        """This process."""
        return cls.of_pid(os.getpid())

    @classmethod
    def of_pid(cls, pid: int) -> OwnerId:
        """The process running as ``pid`` on this host now (``psutil.NoSuchProcess`` if none)."""
        return cls(pid, psutil.Process(pid).create_time(), socket.gethostname())


@dataclass(frozen=True)
class Owner:
    """Who holds a lease: the kernel it is for, the server that asked, and the process to watch."""

    lease_id: str
    kernel_id: str
    server_id: str
    process: OwnerId
    since: float


def is_alive(owner: OwnerId | Owner) -> bool:
    """Whether the owning process still runs.

    Alive means a process with that pid exists, is not a zombie, and started when the recorded
    one did. A process on another host, or one this user may not inspect, counts as alive:
    only a process known to be gone may lose its leases.
    """
    ident = owner.process if isinstance(owner, Owner) else owner
    if ident.hostname != socket.gethostname():
        return True
    try:
        proc = psutil.Process(ident.pid)
        started = proc.create_time()
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:  # ZombieProcess is one too
        return False
    except psutil.AccessDenied:
        return True
    return abs(started - ident.create_time) < START_TIME_TOLERANCE


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One line of the ledger's history.

    ``devices`` are the device uuids the event is about (granted, freed). ``pid`` is the process
    that wrote it and ``seq`` its place in the history; both are filled in by the ledger.
    """

    kind: str
    at: float
    lease_id: str | None = None
    kernel_id: str | None = None
    devices: tuple[str, ...] = ()
    reason: str = ""
    pid: int | None = None
    seq: int | None = None


def _held(lease: Lease | None) -> tuple[str, ...]:
    if lease is None or not lease.holding:
        return ()
    return lease.devices


def _transition_events(before: Lease | None, after: Lease, now: float) -> list[Event]:
    """The history lines for writing ``after`` over ``before``."""

    def event(kind: str, devices: Iterable[str]) -> Event:
        return Event(kind, now, after.id, after.kernel_id, tuple(devices), after.reason)

    out: list[Event] = []
    if before is None:
        out.append(event(CLAIM, ()))
    old, new = _held(before), _held(after)
    lost = [u for u in old if u not in new]
    gained = [u for u in new if u not in old]
    # Free before grant, so that a lease moved between devices never appears to hold both.
    if lost:
        out.append(event(SUSPEND if after.state == LeaseState.SUSPENDED else RELEASE, lost))
    elif after.state == LeaseState.RELEASED and (before is None or before.state != LeaseState.RELEASED):
        out.append(event(RELEASE, ()))
    if gained:
        out.append(event(RESTORE if after.home else GRANT, gained))
    return out


# -- lease rows --------------------------------------------------------------------------------


def _dump(values: Iterable[Any]) -> str:
    return json.dumps(list(values))


def _strs(text: str) -> tuple[str, ...]:
    return tuple(json.loads(text))


def _opt(decode: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else decode(value)


#: Fields stored other than as-is: field -> (to the column, from the column).
_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "groups": (_dump, _strs),
    "devices": (_dump, _strs),
    "home": (_dump, _strs),
    "state": (lambda s: s.value, LeaseState),
    "reclaim_step": (_opt(lambda s: s.value), _opt(Step)),
    "tried_steps": (lambda steps: _dump(s.value for s in steps), lambda t: tuple(Step(v) for v in json.loads(t))),
    "gaps": (_dump, lambda t: tuple(json.loads(t))),
    "busy": (int, bool),
    "created_at": (float, float),
    "queued_at": (float, float),
}
#: One column per ``Lease`` field, in declaration order.
LEASE_COLUMNS = tuple(f.name for f in fields(Lease))
_COLUMN_LIST = ", ".join(f'"{c}"' for c in LEASE_COLUMNS)
_LIVE_STATES = tuple(sorted(s.value for s in LIVE))


def _to_row(lease: Lease) -> tuple[Any, ...]:
    out = []
    for name in LEASE_COLUMNS:
        value = getattr(lease, name)
        codec = _CODECS.get(name)
        out.append(codec[0](value) if codec else value)
    return tuple(out)


def _from_row(row: Sequence[Any]) -> Lease:
    values = {}
    for name, value in zip(LEASE_COLUMNS, row):
        codec = _CODECS.get(name)
        values[name] = codec[1](value) if codec else value
    return Lease(**values)


def _event_from_row(row: Sequence[Any]) -> Event:
    seq, at, kind, lease_id, kernel_id, devices, reason, pid = row
    return Event(kind, at, lease_id, kernel_id, _strs(devices), reason, pid, seq)


# -- schema ------------------------------------------------------------------------------------


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
_TABLES = frozenset({"leases", "events", "owners", "devices", "checkpoints"})


@dataclass(frozen=True)
class Checkpoint:
    """A process whose GPU state this ledger's arbiter moved to host memory and must bring back."""

    pid: int
    create_time: float
    lease_id: str
    kernel_id: str
    devices: tuple[str, ...]
    memory: int | None
    taken_at: float


def _select_checkpoints(conn: sqlite3.Connection, lease_id: str | None = None) -> list[Checkpoint]:
    sql = "SELECT pid, create_time, lease_id, kernel_id, devices, memory, taken_at FROM checkpoints"
    args: tuple[Any, ...] = ()
    if lease_id is not None:
        sql += " WHERE lease_id = ?"
        args = (lease_id,)
    return [
        Checkpoint(r[0], r[1], r[2], r[3], _strs(r[4]), r[5], r[6])
        for r in conn.execute(sql + " ORDER BY taken_at, pid", args)
    ]


def _user_tables(conn: sqlite3.Connection) -> set[str]:
    """The tables in a file, less those SQLite makes by itself."""
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return {n for n in names if not n.startswith("sqlite_")}


def _schema_tables(version: int) -> frozenset[str]:
    """The tables a ledger of schema ``version`` has: its migrations run on an empty database."""
    if version not in _SCHEMA_TABLES:
        conn = sqlite3.connect(":memory:")
        try:
            for step in MIGRATIONS[:version]:
                step(conn)
            _SCHEMA_TABLES[version] = frozenset(_user_tables(conn))
        finally:
            conn.close()
    return _SCHEMA_TABLES[version]


_SCHEMA_TABLES: dict[int, frozenset[str]] = {}


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED
    return "locked" in str(exc) or "busy" in str(exc)


# -- transactions ------------------------------------------------------------------------------


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
        return _select_leases(self._c(), live_only)

    def lease(self, lease_id: str) -> Lease | None:
        """One lease, or ``None`` if the ledger has no such lease."""
        return _select_lease(self._c(), lease_id)

    def put(self, lease: Lease) -> Lease | None:
        """Insert or update ``lease``; return the record it replaced.

        Writing a lease whose ``version`` is not above the stored one raises
        :class:`LedgerConflict` (it was computed from a stale read), unless the two records are
        identical, which writes nothing. Device changes are added to the history.
        """
        conn = self._c()
        before = _select_lease(conn, lease.id)
        if before == lease:
            return before
        if before is not None and lease.version <= before.version:
            raise LedgerConflict(
                f"lease {lease.id} changed since it was read (stored version {before.version}, "
                f"this write version {lease.version}); read it again and retry"
            )
        placeholders = ", ".join("?" for _ in LEASE_COLUMNS)
        updates = ", ".join(f'"{c}" = excluded."{c}"' for c in LEASE_COLUMNS if c != "id")
        conn.execute(
            f"INSERT INTO leases ({_COLUMN_LIST}) VALUES ({placeholders}) ON CONFLICT(id) DO UPDATE SET {updates}",
            _to_row(lease),
        )
        for event in _transition_events(before, lease, self.now):
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
                _dump(event.devices),
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

    def owners(self) -> dict[str, Owner]:
        """Owner of each lease that has one, by lease id."""
        return _select_owners(self._c())

    # checkpoints
    def add_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Record a process whose GPU state was just checkpointed."""
        c = checkpoint
        self._c().execute(
            """INSERT OR REPLACE INTO checkpoints (pid, create_time, lease_id, kernel_id, devices, memory, taken_at)
               VALUES (?, ?, ?, ?, ?, ?, ?)""",
            (c.pid, c.create_time, c.lease_id, c.kernel_id, _dump(c.devices), c.memory, c.taken_at),
        )

    def checkpoints(self, lease_id: str | None = None) -> list[Checkpoint]:
        """Checkpointed processes not restored yet, of one lease or all."""
        return _select_checkpoints(self._c(), lease_id)

    def drop_checkpoint(self, pid: int, create_time: float) -> None:
        """The process was restored (or is gone): forget its checkpoint."""
        self._c().execute("DELETE FROM checkpoints WHERE pid = ? AND create_time = ?", (pid, create_time))

    # devices
    def drained(self) -> dict[str, str]:
        """Drained devices: uuid -> the admin's reason."""
        return _select_drained(self._c())

    def set_drained(self, uuid: str, drained: bool, reason: str = "") -> None:
        """Drain a device (no new grants on it) or put it back into service."""
        conn = self._c()
        was = uuid in _select_drained(conn)
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


def _select_leases(conn: sqlite3.Connection, live_only: bool) -> list[Lease]:
    if live_only:
        marks = ", ".join("?" for _ in _LIVE_STATES)
        rows = conn.execute(
            f"SELECT {_COLUMN_LIST} FROM leases WHERE state IN ({marks}) ORDER BY created_at, id", _LIVE_STATES
        )
    else:
        rows = conn.execute(f"SELECT {_COLUMN_LIST} FROM leases ORDER BY created_at, id")
    return [_from_row(row) for row in rows]


def _select_lease(conn: sqlite3.Connection, lease_id: str) -> Lease | None:
    row = conn.execute(f"SELECT {_COLUMN_LIST} FROM leases WHERE id = ?", (lease_id,)).fetchone()
    return None if row is None else _from_row(row)


def _select_owners(conn: sqlite3.Connection) -> dict[str, Owner]:
    rows = conn.execute("SELECT lease_id, kernel_id, server_id, pid, create_time, hostname, since FROM owners")
    return {
        lease_id: Owner(lease_id, kernel_id, server_id, OwnerId(pid, create_time, hostname), since)
        for lease_id, kernel_id, server_id, pid, create_time, hostname, since in rows
    }


def _select_drained(conn: sqlite3.Connection) -> dict[str, str]:
    return dict(conn.execute("SELECT uuid, reason FROM devices WHERE drained ORDER BY uuid"))


# -- the ledger --------------------------------------------------------------------------------


class Ledger:
    """The ledger file at ``path``, created (mode 0600, parent directories too) if missing.

    The file is never reached through a symbolic link, and one that another user owns or may
    read or write is refused unless ``allow_shared``.

    Args:
        path: the SQLite file.
        allow_shared: accept a file that other users may read or write (the admin shares it on
            purpose).
        busy_timeout: seconds to wait for another process's write transaction before
            :class:`LedgerBusy`.
        clock: the time source for :attr:`Transaction.now` (seconds since the epoch).

    Raises:
        LedgerError: the file is not a ledger this code can use; it was left as it is.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
        allow_shared: bool = False,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.allow_shared = allow_shared
        self.busy_timeout = busy_timeout
        self._clock = clock
        self._lock = threading.RLock()
        self._in_transaction = False
        self._pid = os.getpid()
        self._conn: sqlite3.Connection | None = None
        created = self._prepare_file()
        self._conn = self._open(created)

    # -- opening ---------------------------------------------------------------------------
    def _refuse(self, what: str, exc: BaseException | None = None, advice: str = "") -> LedgerError:
        advice = advice or (
            "Move it aside to start a new, empty ledger (every lease in it is then forgotten) or set "
            "ledger_path to another file"
        )
        return LedgerError(
            f"GPU ledger {self.path} {what}. It was left untouched. {advice}." + (f" ({exc})" if exc else "")
        )

    def _prepare_file(self) -> bool:
        """Check an existing file without writing to it, or create a new one; True if new."""
        try:
            checked = files.prepare(self.path, setting="ledger_path", header_size=len(_SQLITE_MAGIC))
            if checked.header and checked.header != _SQLITE_MAGIC:
                raise files.UnsafeFile("is not a SQLite database")
            files.check_private(
                checked, setting="ledger_path", allow_shared=self.allow_shared, allow_setting=ALLOW_SHARED_SETTING
            )
        except files.UnsafeFile as exc:
            raise self._refuse(exc.problem, advice=exc.advice) from None
        self._checked = checked
        if checked.created:
            log.info("created GPU ledger %s", self.path)
        return not checked.header

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves; the lock makes sharing the
        # connection across threads safe.
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        return conn

    def _open(self, created: bool) -> sqlite3.Connection:
        try:
            conn = self._connect()
        except sqlite3.Error as exc:
            raise self._refuse("cannot be opened", exc) from exc
        try:
            try:
                files.confirm_same(self._checked)
            except files.UnsafeFile as exc:
                raise self._refuse(exc.problem, advice=exc.advice) from None
            # Everything up to the migration only reads, so a file we refuse stays as it was.
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise self._refuse(
                    f"has schema version {version}, newer than the {SCHEMA_VERSION} this version of "
                    "jupyter-gpusched knows (a newer version wrote it); upgrade jupyter-gpusched to use it"
                )
            tables = _user_tables(conn)
            if version == 0 and tables:
                raise self._refuse(
                    f"is a SQLite database but not a GPU ledger (it has tables {', '.join(sorted(tables))})"
                )
            foreign = tables - _schema_tables(version)
            if foreign:
                raise self._refuse(
                    f"is a SQLite database but not a GPU ledger of schema version {version} (it has tables "
                    f"{', '.join(sorted(foreign))} that are not the ledger's)"
                )
            if not created:
                problems = [r[0] for r in conn.execute("PRAGMA quick_check")]
                if problems != ["ok"]:
                    raise self._refuse("is corrupt: " + "; ".join(problems[:3]))
            if version < SCHEMA_VERSION:
                self._migrate(conn)
            # After the migration, so that a migration that fails leaves the file as it was.
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                log.warning("GPU ledger %s: WAL is not available here (journal mode %s)", self.path, mode)
            # A process crash cannot lose a commit with NORMAL in WAL mode; only a power cut
            # can, and that ends every kernel holding a lease as well.
            conn.execute("PRAGMA synchronous = NORMAL")
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not _TABLES <= tables:
                raise self._refuse(f"is missing the tables {', '.join(sorted(_TABLES - tables))}")
        except LedgerError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            if _is_busy(exc):
                raise LedgerBusy(f"GPU ledger {self.path} stayed locked by another process: {exc}") from exc
            raise self._refuse("cannot be read as a SQLite database (it may be damaged)", exc) from exc
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Read again under the write lock: another process may have migrated meanwhile.
            start = conn.execute("PRAGMA user_version").fetchone()[0]
            if start > SCHEMA_VERSION:
                raise self._refuse(f"was just upgraded to schema version {start} by a newer jupyter-gpusched")
            for step in range(start, SCHEMA_VERSION):
                try:
                    MIGRATIONS[step](conn)
                except sqlite3.Error as exc:
                    if _is_busy(exc):
                        raise
                    raise self._refuse(f"could not be upgraded from schema version {step} to {step + 1}", exc) from exc
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # some errors roll back by themselves
                conn.execute("ROLLBACK")
            raise
        if start < SCHEMA_VERSION:
            log.info("GPU ledger %s: schema version %s -> %s", self.path, start, SCHEMA_VERSION)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LedgerError(f"GPU ledger {self.path} is closed")
        if os.getpid() != self._pid:
            # Forked: the parent's connection (and its locks) must not be used or closed here.
            self._pid = os.getpid()
            self._in_transaction = False
            self._conn = self._connect()
        return self._conn

    @property
    def schema_version(self) -> int:
        """The schema version of the file."""
        with self._lock:
            return int(self._connection().execute("PRAGMA user_version").fetchone()[0])

    # -- writing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self, now: float | None = None) -> Iterator[Transaction]:
        """A write transaction: commits when the block ends, rolls back if it raises.

        Args:
            now: the transaction's time; default: the clock, read once the lock is held.

        Raises:
            LedgerBusy: the write lock stayed taken for ``busy_timeout`` seconds.
        """
        with self._lock:
            if self._in_transaction:
                raise LedgerError("a ledger transaction is already open in this thread; finish it first")
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._error(exc) from exc
            self._in_transaction = True
            tx = Transaction(conn, self._clock() if now is None else now)
            try:
                yield tx
            except BaseException as exc:
                tx._open = False
                self._in_transaction = False
                try:
                    if conn.in_transaction:  # some errors roll back by themselves
                        conn.execute("ROLLBACK")
                except sqlite3.Error:
                    log.exception("GPU ledger %s: rollback failed", self.path)
                if isinstance(exc, sqlite3.Error):
                    raise self._error(exc) from exc
                raise
            tx._open = False
            self._in_transaction = False
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                raise self._error(exc) from exc

    def _error(self, exc: sqlite3.Error) -> LedgerError:
        if _is_busy(exc):
            return LedgerBusy(
                f"GPU ledger {self.path} stayed locked by another process for {self.busy_timeout:g}s; try again"
            )
        return LedgerError(f"GPU ledger {self.path}: {exc}")

    def _read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._lock:
            try:
                return fn(self._connection())
            except sqlite3.Error as exc:
                raise self._error(exc) from exc

    # -- reading ---------------------------------------------------------------------------
    def leases(self, live_only: bool = True) -> list[Lease]:
        """The leases, oldest first; released ones too unless ``live_only``."""
        return self._read(lambda c: _select_leases(c, live_only))

    def lease(self, lease_id: str) -> Lease | None:
        """One lease, or ``None``."""
        return self._read(lambda c: _select_lease(c, lease_id))

    def owners(self) -> dict[str, Owner]:
        """Owner of each lease that has one, by lease id."""
        return self._read(_select_owners)

    def drained(self) -> dict[str, str]:
        """Drained devices: uuid -> the admin's reason."""
        return self._read(_select_drained)

    def checkpoints(self, lease_id: str | None = None) -> list[Checkpoint]:
        """Checkpointed processes not restored yet, of one lease or all."""
        return self._read(lambda c: _select_checkpoints(c, lease_id))

    def events(self, lease_id: str | None = None, *, since: int = 0) -> list[Event]:
        """The history in order, after sequence number ``since``, of one lease or all."""
        sql = "SELECT seq, at, kind, lease_id, kernel_id, devices, reason, pid FROM events WHERE seq > ?"
        args: tuple[Any, ...] = (since,)
        if lease_id is not None:
            sql += " AND lease_id = ?"
            args += (lease_id,)
        return self._read(lambda c: [_event_from_row(r) for r in c.execute(sql + " ORDER BY seq", args)])

    # -- upkeep ----------------------------------------------------------------------------
    def reap_dead_owners(self, now: float | None = None) -> list[Lease]:
        """Release every live lease whose owner process is gone; return the released leases."""
        owners = self.owners()
        candidates = {lease.id for lease in self.leases() if lease.id in owners and not is_alive(owners[lease.id])}
        if not candidates:
            return []
        out: list[Lease] = []
        with self.transaction(now) as tx:
            owners = tx.owners()  # again under the lock: the lease may have changed hands
            for lease_id in sorted(candidates):
                lease, owner = tx.lease(lease_id), owners.get(lease_id)
                if lease is None or not lease.live or owner is None or is_alive(owner):
                    continue
                p = owner.process
                done = released(lease, tx.now, f"owner process {p.pid} on {p.hostname} is gone")
                tx.put(done)
                out.append(done)
                log.info(
                    "lease %s of kernel %s released: owner process %s (server %s) is gone",
                    lease.id,
                    lease.kernel_id,
                    p.pid,
                    owner.server_id or "-",
                )
        return out

    def check(self, devices: Sequence[Device] | None = None, *, history: bool = True) -> list[str]:
        """Integrity problems, one sentence each; an empty list means the ledger is sound.

        Checks that no device is held by an exclusive lease and any other live lease, that held
        devices match each lease's state and count, that every live lease has a living owner, that
        a kernel has at most one live lease and, given ``devices``, that shared leases are
        promised no more memory than a device has. With ``history`` it also replays the events:
        no device was ever granted while an exclusive lease held it (or exclusively while anyone
        did), and the replay ends where the leases table stands.
        """

        def read(conn: sqlite3.Connection) -> tuple[list[Lease], dict[str, Owner], list[Event]]:
            # One read transaction, so that the three reads agree.
            conn.execute("BEGIN")
            try:
                leases = _select_leases(conn, live_only=False)
                owners = _select_owners(conn)
                rows = conn.execute(
                    "SELECT seq, at, kind, lease_id, kernel_id, devices, reason, pid FROM events ORDER BY seq"
                ) if history else []
                return leases, owners, [_event_from_row(r) for r in rows]
            finally:
                conn.execute("COMMIT")

        with self._lock:
            if self._in_transaction:
                raise LedgerError("check() reads its own snapshot; call it outside a transaction")
            # Liveness first: a process seen dead before the snapshot cannot have released its
            # lease after it, whereas one that dies after the snapshot may just have released.
            dead = {lid: owner for lid, owner in self.owners().items() if not is_alive(owner)}
            leases, owners, events = self._read(read)
        problems = _check_state(leases, owners, dead, devices)
        if history:
            problems += _check_history(leases, events)
        return problems

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection; the ledger cannot be used afterwards."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and os.getpid() == self._pid:
                conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.path!r})"


def _check_state(
    leases: list[Lease], owners: Mapping[str, Owner], dead: Mapping[str, Owner], devices: Sequence[Device] | None
) -> list[str]:
    problems: list[str] = []
    by_uuid = {d.uuid: d for d in devices} if devices is not None else None
    holders: dict[str, list[Lease]] = {}
    kernels: dict[str, list[str]] = {}
    for lease in leases:
        if not lease.live:
            if lease.devices:
                problems.append(f"lease {lease.id} is released but still lists devices {', '.join(lease.devices)}")
            continue
        kernels.setdefault(lease.kernel_id, []).append(lease.id)
        if lease.holding:
            if len(lease.devices) != lease.count or len(set(lease.devices)) != len(lease.devices):
                problems.append(
                    f"lease {lease.id} is {lease.state.value} with devices {list(lease.devices)} "
                    f"for a claim of {lease.count}"
                )
            for uuid in lease.devices:
                holders.setdefault(uuid, []).append(lease)
        elif lease.devices:
            problems.append(f"lease {lease.id} is {lease.state.value} but lists devices {', '.join(lease.devices)}")
        owner = owners.get(lease.id)
        if owner is None:
            problems.append(
                f"live lease {lease.id} of kernel {lease.kernel_id} has no owner; nothing would ever release it"
            )
        elif dead.get(lease.id) == owner:
            problems.append(
                f"live lease {lease.id} of kernel {lease.kernel_id} belongs to process {owner.process.pid}, "
                "which is gone (reap_dead_owners releases it)"
            )
    for kernel_id, ids in kernels.items():
        if len(ids) > 1:
            problems.append(f"kernel {kernel_id} has {len(ids)} live leases: {', '.join(ids)}")
    for uuid, held_by in sorted(holders.items()):
        exclusive = [le for le in held_by if le.mode == EXCLUSIVE]
        if exclusive and len(held_by) > 1:
            ids = ", ".join(le.id for le in held_by)
            problems.append(
                f"device {uuid} is held by {len(held_by)} leases, {len(exclusive)} of them exclusive: {ids}"
            )
        if by_uuid is None:
            continue
        device = by_uuid.get(uuid)
        if device is None:
            problems.append(f"device {uuid} is held by lease {held_by[0].id} but is not in the inventory")
            continue
        promised = sum(le.promised_memory(device) for le in held_by)
        if not exclusive and promised > device.memory_total:
            problems.append(
                f"device {uuid} (GPU {device.index}) is promised {promised} bytes but has {device.memory_total}: "
                + ", ".join(le.id for le in held_by)
            )
    return problems


def _check_history(leases: list[Lease], events: list[Event]) -> list[str]:
    problems: list[str] = []
    modes = {lease.id: lease.mode for lease in leases}
    holders: dict[str, dict[str, str]] = {}
    for event in events:
        if event.kind not in ACQUIRE_KINDS | FREE_KINDS:
            continue
        if event.lease_id not in modes:
            problems.append(f"event {event.seq} ({event.kind}) is about lease {event.lease_id}, which the ledger lacks")
            continue
        mode = modes[event.lease_id]
        for uuid in event.devices:
            held = holders.setdefault(uuid, {})
            if event.kind in ACQUIRE_KINDS:
                if held and (mode == EXCLUSIVE or EXCLUSIVE in held.values()):
                    problems.append(
                        f"device {uuid} was granted to lease {event.lease_id} (event {event.seq}) while lease "
                        f"{', '.join(sorted(held))} held it"
                    )
                held[event.lease_id] = mode
            elif held.pop(event.lease_id, None) is None:
                problems.append(f"lease {event.lease_id} freed device {uuid} (event {event.seq}) without holding it")
    replayed = {(lid, uuid) for uuid, held in holders.items() for lid in held}
    current = {(lease.id, uuid) for lease in leases for uuid in _held(lease)}
    for lid, uuid in sorted(current - replayed):
        problems.append(f"lease {lid} holds device {uuid} but the history never granted it")
    for lid, uuid in sorted(replayed - current):
        problems.append(f"the history says lease {lid} holds device {uuid} but the lease does not")
    return problems
