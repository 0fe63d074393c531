"""The SQLite ledger: round trips, schema versions, refusals, owners and integrity checks."""

from __future__ import annotations

import itertools
import os
import socket
import sqlite3
import subprocess
import sys
import shutil
import tempfile
import threading
import time
from dataclasses import fields, replace
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpusched.core import (
    EXCLUSIVE,
    SHARED,
    Device,
    GiB,
    Lease,
    LeaseState,
    SchedConfig,
    Step,
    new_claim,
    plan,
    released,
    request_resume,
    suspended,
)
from jupyter_gpusched.ledger import (
    SCHEMA_VERSION,
    Checkpoint,
    Event,
    Ledger,
    LedgerBusy,
    LedgerConflict,
    LedgerError,
    OwnerId,
    is_alive,
)

DEVICES = [Device(uuid=f"GPU-{i}", index=i) for i in range(2)]
HOST = socket.gethostname()


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as led:
        yield led


def full_lease(**changes) -> Lease:
    """A lease with every field set away from its default."""
    lease = Lease(
        id="lease-1",
        kernel_id="kernel-1",
        user="alice",
        count=2,
        memory=16 * GiB,
        mode=SHARED,
        priority=-3,
        created_at=1700000000.125,
        groups=("students", "ml"),
        state=LeaseState.RECLAIMING,
        devices=("GPU-0", "GPU-1"),
        queued_at=1700000001.5,
        granted_at=1700000002.0000002,
        last_active_at=0.1 + 0.2,
        busy=True,
        reclaim_at=1700000099.75,
        reclaim_step=Step.CHECKPOINT,
        keep_until=1700007200.0,
        home=("GPU-1",),
        memory_held=123456789,
        tried_steps=(Step.RELEASE, Step.FREE_CACHE),
        gaps=(1.5, 300.25, 1e-9),
        released_at=1700009999.0,
        reason="idle and bob's claim is waiting; checkpoint ✓",
        version=7,
    )
    return replace(lease, **changes)


def claim(tx, lease_id: str, kernel: str | None = None, **kw) -> Lease:
    lease = new_claim(lease_id, kernel or f"k-{lease_id}", "alice", tx.now, **kw)
    tx.put(lease)
    tx.set_owner(lease.id, lease.kernel_id, "server-1")
    return lease


def schedule(tx, devices=DEVICES):
    result = plan(devices, tx.leases(), {}, tx.now, SchedConfig())
    for lease_id in result.changed:
        tx.put(result.lease(lease_id))
    return result


# -- files -------------------------------------------------------------------------------------


def test_new_ledger_is_private_and_current(tmp_path):
    path = tmp_path / "runtime" / "deep" / "gpusched.sqlite"
    with Ledger(path) as led:
        assert led.schema_version == SCHEMA_VERSION
        assert led.leases() == [] and led.events() == []
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    with Ledger(path) as again:  # reopening is not a migration
        assert again.schema_version == SCHEMA_VERSION


def test_columns_cover_every_lease_field(ledger):
    with sqlite3.connect(ledger.path) as raw:
        columns = [row[1] for row in raw.execute("PRAGMA table_info(leases)")]
    raw.close()
    assert sorted(columns) == sorted(f.name for f in fields(Lease))


# -- round trips -------------------------------------------------------------------------------


def test_every_field_round_trips(ledger):
    lease = full_lease()
    assert all(getattr(lease, f.name) != f.default for f in fields(Lease) if f.name != "id")
    with ledger.transaction() as tx:
        tx.put(lease)
        assert tx.lease(lease.id) == lease
    back = ledger.lease(lease.id)
    assert back == lease
    assert isinstance(back.state, LeaseState) and isinstance(back.reclaim_step, Step)
    assert all(isinstance(s, Step) for s in back.tried_steps)
    assert isinstance(back.groups, tuple) and isinstance(back.gaps, tuple) and back.busy is True
    assert ledger.lease("nope") is None


def test_defaults_and_nones_round_trip(ledger):
    lease = Lease(id="plain", kernel_id="k", user="u")
    with ledger.transaction() as tx:
        tx.put(lease)
    assert ledger.lease("plain") == lease


INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=False)
lease_strategy = st.builds(
    Lease,
    id=st.text(),
    kernel_id=st.text(),
    user=st.text(),
    count=INT64,
    memory=st.none() | INT64,
    mode=st.sampled_from([EXCLUSIVE, SHARED]),
    priority=INT64,
    created_at=FLOATS,
    groups=st.lists(st.text(), max_size=3).map(tuple),
    state=st.sampled_from(LeaseState),
    devices=st.lists(st.text(), max_size=3).map(tuple),
    queued_at=FLOATS,
    granted_at=st.none() | FLOATS,
    last_active_at=st.none() | FLOATS,
    busy=st.booleans(),
    reclaim_at=st.none() | FLOATS,
    reclaim_step=st.none() | st.sampled_from(Step),
    keep_until=st.none() | FLOATS,
    home=st.lists(st.text(), max_size=3).map(tuple),
    memory_held=st.none() | INT64,
    tried_steps=st.lists(st.sampled_from(Step), max_size=5).map(tuple),
    gaps=st.lists(FLOATS, max_size=5).map(tuple),
    released_at=st.none() | FLOATS,
    reason=st.text(),
    version=INT64,
)


def test_any_lease_round_trips(ledger):
    serial = itertools.count()

    @settings(max_examples=200, deadline=None)
    @given(lease_strategy)
    def round_trip(lease):
        lease = replace(lease, id=f"{next(serial)}:{lease.id}")  # every example is a new lease
        with ledger.transaction() as tx:
            tx.put(lease)
        assert ledger.lease(lease.id) == lease

    round_trip()


# -- writes ------------------------------------------------------------------------------------


def test_grant_and_release_write_the_history(ledger):
    with ledger.transaction(now=100.0) as tx:
        claim(tx, "a", count=2)
        schedule(tx)
    with ledger.transaction(now=130.0) as tx:
        tx.put(released(tx.lease("a"), tx.now, "kernel shut down"))
    history = [(e.kind, e.at, e.lease_id, e.devices) for e in ledger.events("a")]
    assert history == [
        ("claim", 100.0, "a", ()),
        ("grant", 100.0, "a", ("GPU-0", "GPU-1")),
        ("release", 130.0, "a", ("GPU-0", "GPU-1")),
    ]
    assert ledger.events("a")[-1].reason == "kernel shut down"
    assert all(e.pid == os.getpid() for e in ledger.events())
    assert ledger.leases() == []
    assert [le.id for le in ledger.leases(live_only=False)] == ["a"]


def test_suspend_and_restore_are_in_the_history(ledger):
    with ledger.transaction(now=1.0) as tx:
        claim(tx, "a")
        schedule(tx)
    with ledger.transaction(now=2.0) as tx:
        tx.put(suspended(tx.lease("a"), tx.now))
        tx.record(Event("notice", tx.now, "a", reason="checkpointed"))
    with ledger.transaction(now=3.0) as tx:
        tx.put(request_resume(tx.lease("a"), tx.now))
        schedule(tx)
    kinds = [(e.kind, e.devices) for e in ledger.events("a")]
    gpu0 = ("GPU-0",)
    assert kinds == [("claim", ()), ("grant", gpu0), ("suspend", gpu0), ("notice", ()), ("restore", gpu0)]
    assert ledger.check(DEVICES) == []


def test_stale_write_is_refused(ledger):
    with ledger.transaction() as tx:
        claim(tx, "a")
    stale = ledger.lease("a")
    with ledger.transaction() as tx:
        schedule(tx)  # granted: version 1
    with pytest.raises(LedgerConflict, match="lease a changed since it was read"):
        with ledger.transaction() as tx:
            tx.put(released(stale, tx.now, "late"))  # also version 1, from before the grant
    assert ledger.lease("a").holding
    before = len(ledger.events())
    with ledger.transaction() as tx:  # writing what is there already is a no-op
        tx.put(tx.lease("a"))
    assert len(ledger.events()) == before


def test_failed_transaction_leaves_nothing(ledger):
    with pytest.raises(RuntimeError, match="boom"):
        with ledger.transaction() as tx:
            claim(tx, "a")
            schedule(tx)
            raise RuntimeError("boom")
    assert ledger.leases(live_only=False) == [] and ledger.events() == [] and ledger.owners() == {}
    with pytest.raises(LedgerError, match="transaction is over"):
        tx.leases()


def test_nested_transaction_is_refused(ledger):
    with ledger.transaction():
        with pytest.raises(LedgerError, match="already open"):
            with ledger.transaction():
                pass


def test_drained_devices(ledger):
    with ledger.transaction() as tx:
        tx.set_drained("GPU-1", True, "fan replacement")
        tx.set_drained("GPU-1", True, "fan replacement")  # no second event
        assert tx.drained() == {"GPU-1": "fan replacement"}
    assert ledger.drained() == {"GPU-1": "fan replacement"}
    with ledger.transaction() as tx:
        tx.set_drained("GPU-1", False)
    assert ledger.drained() == {}
    assert [(e.kind, e.devices) for e in ledger.events()] == [("drain", ("GPU-1",)), ("undrain", ("GPU-1",))]


def test_history_is_append_only(ledger):
    with ledger.transaction() as tx:
        claim(tx, "a")
    raw = sqlite3.connect(ledger.path)
    try:
        for sql in ("UPDATE events SET kind = 'grant'", "DELETE FROM events"):
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                raw.execute(sql)
        # Nor may a live lease go, with its history or without.
        with pytest.raises(sqlite3.DatabaseError, match="live lease cannot be deleted"):
            raw.execute("DELETE FROM leases")
    finally:
        raw.close()


def test_threads_share_one_ledger(ledger):
    errors = []

    def work(n):
        try:
            for i in range(20):
                with ledger.transaction() as tx:
                    claim(tx, f"{n}-{i}")
                    schedule(tx)
                with ledger.transaction() as tx:
                    tx.put(released(tx.lease(f"{n}-{i}"), tx.now, "done"))
                    schedule(tx)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(ledger.leases(live_only=False)) == 80 and ledger.leases() == []
    assert ledger.check(DEVICES) == []


def test_forked_child_uses_its_own_connection(ledger):
    with ledger.transaction() as tx:
        claim(tx, "parent")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        status = 1
        try:
            with ledger.transaction() as tx:
                claim(tx, "child")
            status = 0 if {le.id for le in ledger.leases()} == {"parent", "child"} else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert {le.id for le in ledger.leases()} == {"parent", "child"}
    with ledger.transaction() as tx:  # the parent's connection still works
        tx.put(released(tx.lease("child"), tx.now, "done"))


def test_busy_ledger_says_so(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with Ledger(path, busy_timeout=0.1) as led, pytest.raises(LedgerBusy, match="locked by another process"):
            with led.transaction():
                pass
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_closed_ledger_refuses(tmp_path):
    led = Ledger(tmp_path / "ledger.sqlite")
    led.close()
    led.close()
    with pytest.raises(LedgerError, match="closed"):
        led.leases()


# -- schema versions ---------------------------------------------------------------------------

V1_LEASES = """CREATE TABLE leases (
    "id" TEXT PRIMARY KEY, "kernel_id" TEXT NOT NULL, "user" TEXT NOT NULL, "count" INTEGER NOT NULL,
    "memory" INTEGER, "mode" TEXT NOT NULL, "priority" INTEGER NOT NULL, "created_at" REAL NOT NULL,
    "groups" TEXT NOT NULL, "state" TEXT NOT NULL, "devices" TEXT NOT NULL, "queued_at" REAL NOT NULL,
    "granted_at" REAL, "last_active_at" REAL, "busy" INTEGER NOT NULL, "reclaim_at" REAL,
    "reclaim_step" TEXT, "keep_until" REAL, "home" TEXT NOT NULL, "memory_held" INTEGER,
    "tried_steps" TEXT NOT NULL, "gaps" TEXT NOT NULL, "released_at" REAL, "reason" TEXT NOT NULL,
    "version" INTEGER NOT NULL)"""
V1_EVENTS = """CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL,
    kind TEXT NOT NULL, lease_id TEXT, kernel_id TEXT, devices TEXT NOT NULL DEFAULT '[]',
    reason TEXT NOT NULL DEFAULT '')"""


def write_v1(path, *extra_sql):
    """A schema-1 ledger as that version wrote it: one granted lease and its history."""
    raw = sqlite3.connect(path)
    raw.execute(V1_LEASES)
    raw.execute(V1_EVENTS)
    raw.execute(
        "INSERT INTO leases VALUES ('old', 'k-old', 'alice', 1, NULL, 'exclusive', 0, 10.0, '[]', 'active', "
        "'[\"GPU-0\"]', 10.0, 11.0, 11.0, 0, NULL, NULL, NULL, '[]', NULL, '[]', '[2.5]', NULL, 'granted', 1)"
    )
    raw.execute("INSERT INTO events (at, kind, lease_id, kernel_id) VALUES (10.0, 'claim', 'old', 'k-old')")
    raw.execute(
        "INSERT INTO events (at, kind, lease_id, kernel_id, devices, reason) "
        "VALUES (11.0, 'grant', 'old', 'k-old', '[\"GPU-0\"]', 'granted')"
    )
    for sql in extra_sql:
        raw.execute(sql)
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()
    os.chmod(path, 0o600)  # as the ledger makes its files


def test_migrates_a_version_1_file(tmp_path):
    path = tmp_path / "v1.sqlite"
    write_v1(path)
    with Ledger(path) as led:
        assert led.schema_version == SCHEMA_VERSION == 5
        old = led.lease("old")
        assert old.state == LeaseState.ACTIVE and old.devices == ("GPU-0",) and old.gaps == (2.5,)
        assert [(e.kind, e.pid) for e in led.events()] == [("claim", None), ("grant", None)]
        # What version 2 added works on the migrated file.
        with led.transaction() as tx:
            tx.set_owner("old", "k-old", "server-1")
            tx.set_drained("GPU-1", True)
            tx.put(released(tx.lease("old"), tx.now, "done"))
        assert led.events()[-1].pid == os.getpid()
        assert led.check(DEVICES) == []
        # What version 3 added too: checkpoints taken are kept until their process is restored.
        with led.transaction() as tx:
            tx.add_checkpoint(Checkpoint(4242, 99.5, "old", "k-old", ("GPU-0",), 2**30, tx.now))
        assert [(c.pid, c.lease_id, c.devices) for c in led.checkpoints()] == [(4242, "old", ("GPU-0",))]
        with led.transaction() as tx:
            tx.drop_checkpoint(4242, 99.5)
        assert led.checkpoints() == []
        # And what version 4 added: the released lease and its history can be pruned.
        assert led.prune(older_than=time.time() + 60) == 1
        assert led.lease("old") is None and led.events("old") == [] and led.owners(live_only=False) == {}
        assert [e.kind for e in led.events()] == ["drain"]
        assert (led.pruned().leases, led.pruned().events) == (1, 3)
        assert led.check(DEVICES) == []


def test_failed_migration_changes_nothing(tmp_path):
    path = tmp_path / "v1.sqlite"
    # A stray index in the way makes the step to version 2 fail half way.
    write_v1(path, "CREATE INDEX events_lease ON events(kind)")
    refused(path, "could not be upgraded from schema version 1 to 2")
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == 1
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "owners" not in tables
        assert [r[1] for r in raw.execute("PRAGMA table_info(events)")][-1] == "reason"  # no pid column
    finally:
        raw.close()


def refused(path, match):
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(LedgerError, match=match) as info:
        Ledger(path)
    assert str(path) in str(info.value)
    assert "left untouched" in str(info.value)
    if before is not None:
        assert path.read_bytes() == before
    return info.value


def test_newer_schema_is_refused_untouched(tmp_path):
    path = tmp_path / "future.sqlite"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE leases (id TEXT, hologram BLOB)")
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    path.chmod(0o600)
    err = refused(path, "newer")
    assert "upgrade jupyter-gpusched" in str(err)


def test_not_sqlite_is_refused_untouched(tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_text("this is my thesis, not a database\n" * 100)
    refused(path, "not a SQLite database")


def test_foreign_sqlite_is_refused_untouched(tmp_path):
    path = tmp_path / "other.sqlite"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE recipes (name TEXT)")
    raw.commit()
    raw.close()
    path.chmod(0o600)
    refused(path, "not a GPU ledger")


def test_corrupt_file_is_refused_untouched(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        with led.transaction() as tx:
            for i in range(300):
                tx.put(full_lease(id=f"lease-{i}", reason="x" * 200))
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 8 * page
    data[3 * page : 6 * page] = b"\xde\xad\xbe\xef" * (3 * page // 4)
    path.write_bytes(bytes(data))
    refused(path, "corrupt|damaged")


def test_truncated_file_is_refused_untouched(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    path.write_bytes(path.read_bytes()[:50])
    refused(path, "cannot be read")


def test_directory_is_refused(tmp_path):
    refused(tmp_path, "is a directory")


def test_unreadable_file_is_refused_untouched(tmp_path):
    if os.geteuid() != 0:
        path = tmp_path / "ledger.sqlite"
        Ledger(path).close()
        path.chmod(0)
        try:
            refused(path, "permissions")
        finally:
            path.chmod(0o600)
        return
    # root reads anything: open root's private ledger as an unprivileged user instead.
    shared = Path(tempfile.mkdtemp())
    try:
        shared.chmod(0o755)
        path = shared / "ledger.sqlite"
        Ledger(path).close()
        before = path.read_bytes()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            status = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                Ledger(path)
            except LedgerError as exc:
                os.write(write_end, str(exc).encode())
                status = 3
            finally:
                os._exit(status)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            message = pipe.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3, message
        assert str(path) in message and "permissions" in message and "left untouched" in message
        assert path.read_bytes() == before
    finally:
        shutil.rmtree(shared)


# -- owners ------------------------------------------------------------------------------------


def test_owner_identity():
    me = OwnerId.current()
    assert me.pid == os.getpid() and me.hostname == HOST
    assert is_alive(me)
    assert not is_alive(replace(me, create_time=me.create_time - 3600)), "a reused pid is not the owner"
    assert is_alive(replace(me, hostname=HOST + "-elsewhere")), "another host's process cannot be judged"
    with open("/proc/sys/kernel/pid_max") as f:
        unused = int(f.read()) + 1
    assert not is_alive(OwnerId(unused, me.create_time, HOST))


def test_zombie_is_dead():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    owner = OwnerId.of_pid(proc.pid)
    try:
        deadline = time.time() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.time() < deadline
        assert not is_alive(owner)
    finally:
        proc.wait()
    assert not is_alive(owner)


def test_reap_releases_only_dead_owners(ledger):
    me = OwnerId.current()
    impostor = replace(me, create_time=me.create_time - 100)  # same pid, different process
    with ledger.transaction() as tx:
        for lease_id, owner in (("mine", me), ("reused", impostor)):
            lease = new_claim(lease_id, f"k-{lease_id}", "alice", tx.now)
            tx.put(lease)
            tx.set_owner(lease_id, lease.kernel_id, "server-1", owner)
        schedule(tx)
    assert {le.id for le in ledger.leases() if le.holding} == {"mine", "reused"}
    assert any("reused" in p and "gone" in p for p in ledger.check(DEVICES))

    reaped = ledger.reap_dead_owners(now=500.0)
    assert [le.id for le in reaped] == ["reused"]
    gone = ledger.lease("reused")
    assert gone.state == LeaseState.RELEASED and gone.released_at == 500.0 and f"{me.pid}" in gone.reason
    assert [e.kind for e in ledger.events("reused")][-1] == "release"
    assert [le.id for le in ledger.leases()] == ["mine"]
    assert ledger.owners()["mine"].process == me
    assert ledger.reap_dead_owners() == []
    assert ledger.check(DEVICES) == []


# -- integrity ---------------------------------------------------------------------------------


def test_check_finds_double_grants_and_overpromised_memory(ledger):
    with ledger.transaction(now=1.0) as tx:
        claim(tx, "a")
        schedule(tx)
        # A buggy writer hands the same GPU to a second exclusive lease.
        b = replace(claim(tx, "b"), state=LeaseState.ACTIVE, devices=("GPU-0",), version=1)
        tx.put(b)
        for lid in ("s1", "s2"):
            shared = claim(tx, lid, mode=SHARED, memory=50 * GiB)
            tx.put(replace(shared, state=LeaseState.ACTIVE, devices=("GPU-1",), version=1))
    problems = ledger.check(DEVICES)
    assert any("device GPU-0 is held by 2 leases" in p for p in problems)
    assert any("GPU-0 was granted to lease b" in p and "while lease a held it" in p for p in problems)
    assert any("GPU-1 (GPU 1) is promised" in p for p in problems)
    assert ledger.check() != [] and not any("promised" in p for p in ledger.check())


def test_check_finds_leases_without_owner_or_history(ledger):
    with ledger.transaction() as tx:
        tx.put(new_claim("orphan", "k", "alice", tx.now))
    with sqlite3.connect(ledger.path) as raw:  # a grant written behind the ledger's back
        raw.execute("""UPDATE leases SET state = 'active', devices = '["GPU-0"]' WHERE id = 'orphan'""")
    raw.close()
    problems = ledger.check(DEVICES)
    assert any("orphan" in p and "no owner" in p for p in problems)
    assert any("orphan holds device GPU-0 but the history never granted it" in p for p in problems)
