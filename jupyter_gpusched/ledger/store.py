"""The ledger file: opening, checking and migrating it, transactions, reads and upkeep."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from .. import files
from ..core import Device, Lease, released
from ..procs import is_alive
from .audit import check_history, check_state
from .errors import LedgerBusy, LedgerError, LedgerWouldBlock, is_busy
from .rows import (
    Checkpoint,
    Event,
    Owner,
    Pruned,
    event_from_row,
    select_checkpoints,
    select_drained,
    select_kernel_users,
    select_lease,
    select_leases,
    select_owners,
    select_pruned,
    select_usage,
)
from ..core.usage import Accrued
from .schema import MIGRATIONS, SCHEMA_VERSION, SQLITE_MAGIC, TABLES, schema_tables, user_tables
from .transaction import Transaction

__all__ = ["ALLOW_SHARED_SETTING", "Ledger"]

# The package's one logger, named as before the ledger became a package.
log = logging.getLogger("jupyter_gpusched.ledger")

#: The setting that lets an admin share the ledger with other users on purpose.
ALLOW_SHARED_SETTING = "c.GPUSchedApp.allow_shared_state_files (c.GPUBroker.allow_shared_state_files for the broker)"


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
            checked = files.prepare(self.path, setting="ledger_path", header_size=len(SQLITE_MAGIC))
            if checked.header and checked.header != SQLITE_MAGIC:
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
            tables = user_tables(conn)
            if version == 0 and tables:
                raise self._refuse(
                    f"is a SQLite database but not a GPU ledger (it has tables {', '.join(sorted(tables))})"
                )
            foreign = tables - schema_tables(version)
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
            if not TABLES <= tables:
                raise self._refuse(f"is missing the tables {', '.join(sorted(TABLES - tables))}")
        except LedgerError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            if is_busy(exc):
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
                    if is_busy(exc):
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
    def transaction(self, now: float | None = None, *, wait: bool = True) -> Iterator[Transaction]:
        """A write transaction: commits when the block ends, rolls back if it raises.

        Args:
            now: the transaction's time; default: the clock, read once the lock is held.
            wait: False to fail at once with :class:`LedgerWouldBlock` where another thread or
                process holds the write lock (an event loop then hands the work to a thread).

        Raises:
            LedgerBusy: the write lock stayed taken for ``busy_timeout`` seconds.
            LedgerWouldBlock: ``wait`` is False and the write lock is taken.
        """
        if not self._lock.acquire(blocking=wait):
            raise LedgerWouldBlock(f"GPU ledger {self.path} is being written by another thread")
        try:
            if self._in_transaction:
                raise LedgerError("a ledger transaction is already open in this thread; finish it first")
            conn = self._connection()
            self._begin(conn, wait)
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
        finally:
            self._lock.release()

    def _begin(self, conn: sqlite3.Connection, wait: bool) -> None:
        if wait:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._error(exc) from exc
            return
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            if is_busy(exc):
                raise LedgerWouldBlock(f"GPU ledger {self.path} is being written by another process") from None
            raise self._error(exc) from exc
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")

    def _error(self, exc: sqlite3.Error) -> LedgerError:
        if is_busy(exc):
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
        return self._read(lambda c: select_leases(c, live_only))

    def lease(self, lease_id: str) -> Lease | None:
        """One lease, or ``None``."""
        return self._read(lambda c: select_lease(c, lease_id))

    def kernel_users(self, released_since: float) -> dict[str, str]:
        """Whose each kernel is, by kernel id: the user of its live lease, or of a lease released
        at ``released_since`` or later (a broker that restarts knows its kernels' users from it)."""
        return self._read(lambda c: select_kernel_users(c, released_since))

    def owners(self, live_only: bool = True) -> dict[str, Owner]:
        """Owner of each live lease that has one, by lease id; of released ones too unless ``live_only``."""
        return self._read(lambda c: select_owners(c, live_only))

    def drained(self) -> dict[str, str]:
        """Drained devices: uuid -> the admin's reason."""
        return self._read(select_drained)

    def checkpoints(self, lease_id: str | None = None) -> list[Checkpoint]:
        """Checkpointed processes not restored yet, of one lease or all."""
        return self._read(lambda c: select_checkpoints(c, lease_id))

    def usage(self) -> dict[str, Accrued]:
        """Each subject's recent usage record (``core.usage``): ``user:NAME`` and ``group:NAME``."""
        return self._read(select_usage)

    def pruned(self) -> Pruned | None:
        """What :meth:`prune` took out so far, or ``None`` if the history is complete."""
        return self._read(select_pruned)

    def events(self, lease_id: str | None = None, *, since: int = 0) -> list[Event]:
        """The history in order, after sequence number ``since``, of one lease or all."""
        sql = "SELECT seq, at, kind, lease_id, kernel_id, devices, reason, pid FROM events WHERE seq > ?"
        args: tuple[Any, ...] = (since,)
        if lease_id is not None:
            sql += " AND lease_id = ?"
            args += (lease_id,)
        return self._read(lambda c: [event_from_row(r) for r in c.execute(sql + " ORDER BY seq", args)])

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

    def prune(self, older_than: float, batch: int = 500) -> int:
        """Delete at most ``batch`` leases released before ``older_than``; return how many.

        One short write transaction (see :meth:`Transaction.prune` for what goes with a lease).
        It blocks: call it off the event loop, again while it returns ``batch``.

        Args:
            older_than: seconds since the epoch (e.g. ``time.time() - history_days * 86400``);
                a lease released at this time or later stays.
            batch: the most leases deleted by this call (at least 1).

        Raises:
            LedgerBusy: the write lock stayed taken for ``busy_timeout`` seconds.
        """
        with self.transaction() as tx:
            pruned = tx.prune(older_than, batch)
        if pruned:
            log.info("GPU ledger %s: pruned %d leases released before %.0f", self.path, pruned, older_than)
        return pruned

    def prune_all(self, older_than: float, batch: int = 500) -> int:
        """:meth:`prune` again and again, one short transaction each, until fewer than ``batch``
        go; return how many went in all (it blocks: call it off the event loop)."""
        total = 0
        while True:
            done = self.prune(older_than, batch)
            total += done
            if done < batch:
                return total

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
                leases = select_leases(conn, live_only=False)
                owners = select_owners(conn, live_only=True)
                rows = conn.execute(
                    "SELECT seq, at, kind, lease_id, kernel_id, devices, reason, pid FROM events ORDER BY seq"
                ) if history else []
                return leases, owners, [event_from_row(r) for r in rows]
            finally:
                conn.execute("COMMIT")

        with self._lock:
            if self._in_transaction:
                raise LedgerError("check() reads its own snapshot; call it outside a transaction")
            # Liveness first: a process seen dead before the snapshot cannot have released its
            # lease after it, whereas one that dies after the snapshot may just have released.
            dead = {lid: owner for lid, owner in self.owners().items() if not is_alive(owner)}
            leases, owners, events = self._read(read)
        problems = check_state(leases, owners, dead, devices)
        if history:
            problems += check_history(leases, events)
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
