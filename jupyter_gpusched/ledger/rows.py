"""Rows and records: what the ledger stores, and how a ``Lease`` becomes a row and back."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Sequence

from ..core import Lease, LeaseState, Step
from ..core.model import LIVE
from ..core.usage import Accrued
from ..procs import OwnerId

__all__ = [
    "COLUMN_LIST",
    "LEASE_COLUMNS",
    "Checkpoint",
    "Event",
    "Owner",
    "Pruned",
    "event_from_row",
    "from_row",
    "select_checkpoints",
    "select_drained",
    "select_lease",
    "select_leases",
    "select_owners",
    "select_pruned",
    "select_usage",
    "to_row",
]


@dataclass(frozen=True)
class Owner:
    """Who holds a lease: the kernel it is for, the server that asked, and the process to watch."""

    lease_id: str
    kernel_id: str
    server_id: str
    process: OwnerId
    since: float


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


@dataclass(frozen=True)
class Pruned:
    """What retention took out of the ledger, all prunes together."""

    leases: int
    events: int
    #: When the most recently released of the pruned leases was released: every pruned lease
    #: was released at or before it.
    last_released_at: float
    #: When the last prune ran.
    at: float


def dump(values: Iterable[Any]) -> str:
    return json.dumps(list(values))


def strs(text: str) -> tuple[str, ...]:
    return tuple(json.loads(text))


def opt(decode: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else decode(value)


#: Fields stored other than as-is: field -> (to the column, from the column).
CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "groups": (dump, strs),
    "devices": (dump, strs),
    "home": (dump, strs),
    "state": (lambda s: s.value, LeaseState),
    "reclaim_step": (opt(lambda s: s.value), opt(Step)),
    "tried_steps": (lambda steps: dump(s.value for s in steps), lambda t: tuple(Step(v) for v in json.loads(t))),
    "gaps": (dump, lambda t: tuple(json.loads(t))),
    "busy": (int, bool),
    "created_at": (float, float),
    "queued_at": (float, float),
}
#: One column per ``Lease`` field, in declaration order.
LEASE_COLUMNS = tuple(f.name for f in fields(Lease))
COLUMN_LIST = ", ".join(f'"{c}"' for c in LEASE_COLUMNS)
LIVE_STATES = tuple(sorted(s.value for s in LIVE))


def to_row(lease: Lease) -> tuple[Any, ...]:
    out = []
    for name in LEASE_COLUMNS:
        value = getattr(lease, name)
        codec = CODECS.get(name)
        out.append(codec[0](value) if codec else value)
    return tuple(out)


def from_row(row: Sequence[Any]) -> Lease:
    values = {}
    for name, value in zip(LEASE_COLUMNS, row):
        codec = CODECS.get(name)
        values[name] = codec[1](value) if codec else value
    return Lease(**values)


def event_from_row(row: Sequence[Any]) -> Event:
    seq, at, kind, lease_id, kernel_id, devices, reason, pid = row
    return Event(kind, at, lease_id, kernel_id, strs(devices), reason, pid, seq)


def select_leases(conn: sqlite3.Connection, live_only: bool) -> list[Lease]:
    if live_only:
        marks = ", ".join("?" for _ in LIVE_STATES)
        rows = conn.execute(
            f"SELECT {COLUMN_LIST} FROM leases WHERE state IN ({marks}) ORDER BY created_at, id", LIVE_STATES
        )
    else:
        rows = conn.execute(f"SELECT {COLUMN_LIST} FROM leases ORDER BY created_at, id")
    return [from_row(row) for row in rows]


def select_kernel_users(conn: sqlite3.Connection, released_since: float) -> dict[str, str]:
    """The hub user of each kernel with a live lease, or a lease released at ``released_since``
    or later (the latest lease's user where a kernel had several)."""
    marks = ", ".join("?" for _ in LIVE_STATES)
    rows = conn.execute(
        f'SELECT kernel_id, "user" FROM leases WHERE state IN ({marks}) OR released_at >= ? ORDER BY created_at, id',
        (*LIVE_STATES, released_since),
    )
    return {kernel_id: user for kernel_id, user in rows}


def select_lease(conn: sqlite3.Connection, lease_id: str) -> Lease | None:
    row = conn.execute(f"SELECT {COLUMN_LIST} FROM leases WHERE id = ?", (lease_id,)).fetchone()
    return None if row is None else from_row(row)


def select_owners(conn: sqlite3.Connection, live_only: bool = True) -> dict[str, Owner]:
    columns = "o.lease_id, o.kernel_id, o.server_id, o.pid, o.create_time, o.hostname, o.since"
    if live_only:
        # Through the leases' state index: every pass reads owners, and released leases'
        # owners (kept until pruned) outnumber the live ones.
        marks = ", ".join("?" for _ in LIVE_STATES)
        rows = conn.execute(
            f"SELECT {columns} FROM leases AS l JOIN owners AS o ON o.lease_id = l.id WHERE l.state IN ({marks})",
            LIVE_STATES,
        )
    else:
        rows = conn.execute(f"SELECT {columns} FROM owners AS o")
    return {
        lease_id: Owner(lease_id, kernel_id, server_id, OwnerId(pid, create_time, hostname), since)
        for lease_id, kernel_id, server_id, pid, create_time, hostname, since in rows
    }


def select_usage(conn: sqlite3.Connection) -> dict[str, Accrued]:
    return {
        r[0]: Accrued(r[1], r[2], r[3])
        for r in conn.execute("SELECT subject, gpu_seconds, held, as_of FROM usage ORDER BY subject")
    }


def select_drained(conn: sqlite3.Connection) -> dict[str, str]:
    return dict(conn.execute("SELECT uuid, reason FROM devices WHERE drained ORDER BY uuid"))


def select_checkpoints(conn: sqlite3.Connection, lease_id: str | None = None) -> list[Checkpoint]:
    sql = "SELECT pid, create_time, lease_id, kernel_id, devices, memory, taken_at FROM checkpoints"
    args: tuple[Any, ...] = ()
    if lease_id is not None:
        sql += " WHERE lease_id = ?"
        args = (lease_id,)
    return [
        Checkpoint(r[0], r[1], r[2], r[3], strs(r[4]), r[5], r[6])
        for r in conn.execute(sql + " ORDER BY taken_at, pid", args)
    ]


def select_pruned(conn: sqlite3.Connection) -> Pruned | None:
    row = conn.execute("SELECT leases, events, last_released_at, at FROM pruned WHERE id = 1").fetchone()
    return None if row is None else Pruned(*row)
