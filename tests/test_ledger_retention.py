"""Retention: old released leases leave the ledger with their history; nothing live ever does."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from jupyter_gpusched.core import Device, LeaseState, SchedConfig, new_claim, plan, released, suspended
from jupyter_gpusched.ledger import MIGRATIONS, SCHEMA_VERSION, Checkpoint, Ledger, LedgerError, OwnerId
from jupyter_gpusched.ledger.rows import COLUMN_LIST, LEASE_COLUMNS, to_row

DEVICES = [Device(uuid=f"GPU-{i}", index=i) for i in range(6)]
WORKER = str(Path(__file__).with_name("ledger_worker.py"))
DAY = 86400.0


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as led:
        yield led


def claim(tx, lease_id: str, **kw):
    lease = new_claim(lease_id, f"k-{lease_id}", "alice", tx.now, **kw)
    tx.put(lease)
    tx.set_owner(lease.id, lease.kernel_id, "server-1")
    return lease


def schedule(tx):
    result = plan(DEVICES, tx.leases(), {}, tx.now, SchedConfig())
    for lease_id in result.changed:
        tx.put(result.lease(lease_id))


def release(ledger, lease_id: str, at: float):
    with ledger.transaction(now=at) as tx:
        tx.put(released(tx.lease(lease_id), tx.now, "done"))


def history(ledger):
    """Old released leases a and b, a recent released c, and live leases of every age.

    ``d`` and ``e`` (a claim of four that waits at first) were claimed on day 1, ``s`` suspended;
    ``cp`` was released on day 1 but keeps a checkpoint not restored yet.
    """
    with ledger.transaction(now=1 * DAY) as tx:
        for lease_id in ("a", "b", "cp", "d", "s"):
            claim(tx, lease_id)
        schedule(tx)
        tx.put(suspended(tx.lease("s"), tx.now))
    with ledger.transaction(now=1 * DAY) as tx:
        claim(tx, "e", count=4)  # waits: only two GPUs are free
        schedule(tx)
        tx.set_drained("GPU-5", True, "maintenance")
        tx.add_checkpoint(Checkpoint(4242, 1.5, "cp", "k-cp", tx.lease("cp").devices, None, tx.now))
    release(ledger, "a", 2 * DAY)
    release(ledger, "b", 3 * DAY)
    release(ledger, "cp", 3 * DAY)
    with ledger.transaction(now=9 * DAY) as tx:
        claim(tx, "c")
        schedule(tx)
    release(ledger, "c", 10 * DAY)


def ids(leases):
    return {lease.id for lease in leases}


def test_prune_takes_only_old_released_leases_and_all_that_is_theirs(ledger):
    history(ledger)
    before = {lease_id: ledger.events(lease_id) for lease_id in "cdes"}
    assert ledger.check(DEVICES) == []

    assert ledger.prune(older_than=5 * DAY) == 2
    assert ids(ledger.leases(live_only=False)) == {"c", "cp", "d", "e", "s"}
    for gone in "ab":
        assert ledger.lease(gone) is None and ledger.events(gone) == []
    assert set(ledger.owners(live_only=False)) == {"c", "cp", "d", "e", "s"}
    # What stays is untouched: the recent lease, the live ones whatever their age, the drain.
    assert {lease_id: ledger.events(lease_id) for lease_id in "cdes"} == before
    assert all(ledger.lease(lease_id).live for lease_id in "des")
    assert ledger.lease("s").state == LeaseState.SUSPENDED
    assert ledger.drained() == {"GPU-5": "maintenance"}
    assert [e.kind for e in ledger.events() if e.lease_id is None] == ["drain"]
    # A checkpoint not restored yet keeps its lease until the process is restored.
    assert ledger.lease("cp") is not None and len(ledger.checkpoints("cp")) == 1
    assert ledger.check(DEVICES) == []

    pruned = ledger.pruned()
    assert (pruned.leases, pruned.last_released_at) == (2, 3 * DAY)
    assert pruned.events == 6  # claim, grant, release of each

    assert ledger.prune(older_than=5 * DAY) == 0
    with ledger.transaction() as tx:
        tx.drop_checkpoint(4242, 1.5)
    assert ledger.prune(older_than=5 * DAY) == 1
    assert ledger.lease("cp") is None and ledger.events("cp") == []
    assert ledger.check(DEVICES) == []


def test_live_leases_are_never_pruned(ledger):
    history(ledger)
    far_future = time.time() + 1000 * DAY
    while ledger.prune(older_than=far_future, batch=1) == 1:
        pass
    live = ledger.leases()
    assert ids(live) == {"d", "e", "s"} == ids(ledger.leases(live_only=False)) - {"cp"}
    assert all(ledger.events(lease.id)[0].kind == "claim" for lease in live)
    assert ledger.check(DEVICES) == []


def test_prune_goes_oldest_first_in_batches(ledger):
    with ledger.transaction(now=0.0) as tx:
        for n in range(7):
            claim(tx, f"l{n}")
    for n in range(7):
        release(ledger, f"l{n}", 100.0 + n)
    assert ledger.prune(older_than=1000.0, batch=3) == 3
    assert ids(ledger.leases(live_only=False)) == {"l3", "l4", "l5", "l6"}
    assert ledger.prune(older_than=1000.0, batch=3) == 3
    assert ledger.prune(older_than=1000.0, batch=3) == 1  # fewer than the batch: done
    assert ledger.pruned().leases == 7 and ledger.pruned().last_released_at == 106.0
    with pytest.raises(ValueError, match="batch"):
        ledger.prune(older_than=1000.0, batch=0)


def test_a_lease_released_at_the_cutoff_stays(ledger):
    with ledger.transaction(now=0.0) as tx:
        claim(tx, "x")
    release(ledger, "x", 100.0)
    assert ledger.prune(older_than=100.0) == 0
    assert ledger.prune(older_than=100.5) == 1


def test_history_of_what_stays_is_still_append_only(ledger):
    history(ledger)
    ledger.prune(older_than=5 * DAY)
    with sqlite3.connect(ledger.path) as raw:
        for sql in ("DELETE FROM events WHERE lease_id = 'c'", "DELETE FROM events WHERE lease_id IS NULL"):
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                raw.execute(sql)
        with pytest.raises(sqlite3.DatabaseError, match="live lease cannot be deleted"):
            raw.execute("DELETE FROM leases WHERE id = 'd'")
    raw.close()


def test_a_pruned_ledger_takes_new_claims_and_checks_clean(ledger):
    history(ledger)
    release(ledger, "d", 4 * DAY)
    assert ledger.prune(older_than=5 * DAY) == 3
    with ledger.transaction(now=11 * DAY) as tx:
        claim(tx, "a")  # a pruned lease's id and kernel are free again
        claim(tx, "d2")
        schedule(tx)
    assert ledger.lease("a").holding and ledger.lease("d2").holding
    assert [e.kind for e in ledger.events("a")] == ["claim", "grant"]
    assert ledger.check(DEVICES) == []


def test_owners_of_released_leases_are_read_only_on_request(ledger):
    history(ledger)
    assert set(ledger.owners()) == {"d", "e", "s"}
    assert set(ledger.owners(live_only=False)) == {"a", "b", "c", "cp", "d", "e", "s"}
    with ledger.transaction() as tx:
        assert set(tx.owners()) == {"d", "e", "s"}


# -- two processes -----------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_claim_release_and_prune_one_file(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    procs = []
    for n in range(2):
        out = tmp_path / f"worker-{n}.json"
        args = ("--worker", str(n), "--seconds", "4", "--seed", str(n), "--history", "0.2", "--out", str(out))
        procs.append((subprocess.Popen(
            [sys.executable, WORKER, "churn", str(path), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ), out))
    for proc, _ in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output
    results = [json.loads(out.read_text()) for _, out in procs]
    committed = {lease_id for r in results for lease_id in r["committed"]}
    pruned = sum(r["pruned"] for r in results)
    assert pruned > 0, "the workers pruned while the other one claimed"

    with Ledger(path) as ledger:
        left = {lease.id: lease for lease in ledger.leases(live_only=False)}
        assert ledger.leases() == []
        assert ledger.pruned().leases == pruned
        assert set(left) <= committed and len(committed) == len(left) + pruned
        events = ledger.events()
        assert {ev.lease_id for ev in events} == set(left)
        for lease_id in left:
            assert [ev.kind for ev in events if ev.lease_id == lease_id] == ["claim", "grant", "release"]
        assert set(ledger.owners(live_only=False)) == set(left)
        assert ledger.check(DEVICES) == []
        # And it goes on: a claim after all that is granted and checks clean.
        with ledger.transaction() as tx:
            claim(tx, "after")
            schedule(tx)
        assert ledger.lease("after").holding
        assert ledger.check(DEVICES) == []


# -- migration ---------------------------------------------------------------------------------


def write_v3(path, *extra_sql):
    """A schema-3 ledger as that version wrote it: a released lease and a granted one, with history."""
    raw = sqlite3.connect(path)
    for step in MIGRATIONS[:3]:
        step(raw)
    me = OwnerId.current()
    rows = [
        (new_claim("old", "k-old", "alice", 10.0), ["claim", "grant", "release"]),
        (new_claim("live", "k-live", "alice", 20.0), ["claim", "grant"]),
    ]
    for n, (lease, kinds) in enumerate(rows):
        device = f"GPU-{n}"
        if "release" in kinds:
            lease = released(lease, 30.0, "done")
        else:
            lease = replace(lease, state=LeaseState.ACTIVE, devices=(device,), granted_at=21.0, version=1)
        marks = ", ".join("?" for _ in LEASE_COLUMNS)
        raw.execute(f"INSERT INTO leases ({COLUMN_LIST}) VALUES ({marks})", to_row(lease))
        for kind in kinds:
            devices = "[]" if kind == "claim" else json.dumps([device])
            raw.execute(
                "INSERT INTO events (at, kind, lease_id, kernel_id, devices, pid) VALUES (?, ?, ?, ?, ?, ?)",
                (lease.created_at, kind, lease.id, lease.kernel_id, devices, os.getpid()),
            )
        raw.execute(
            "INSERT INTO owners VALUES (?, ?, 'server-1', ?, ?, ?, ?)",
            (lease.id, lease.kernel_id, me.pid, me.create_time, me.hostname, lease.created_at),
        )
    for sql in extra_sql:
        raw.execute(sql)
    raw.execute("PRAGMA user_version = 3")
    raw.commit()
    raw.close()
    os.chmod(path, 0o600)


def indexes(path) -> set[str]:
    with sqlite3.connect(path) as raw:
        names = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    raw.close()
    return {n for n in names if not n.startswith("sqlite_")}


def test_migrates_a_version_3_file(tmp_path):
    path = tmp_path / "v3.sqlite"
    write_v3(path)
    assert "leases_state" in indexes(path)
    with Ledger(path) as led:
        assert led.schema_version == SCHEMA_VERSION == 5
        assert led.check(DEVICES) == [] and led.pruned() is None
        assert ids(led.leases()) == {"live"} and set(led.owners()) == {"live"}
        assert led.prune(older_than=100.0) == 1
        assert led.lease("old") is None and led.events("old") == []
        assert [e.kind for e in led.events("live")] == ["claim", "grant"]
        assert (led.pruned().leases, led.pruned().events) == (1, 3)
        assert led.check(DEVICES) == []
        with led.transaction() as tx:
            tx.put(released(tx.lease("live"), tx.now, "done"))
        assert led.check(DEVICES) == []
    assert "leases_state" not in indexes(path) and "leases_state_released" in indexes(path)


def test_failed_migration_to_version_4_changes_nothing(tmp_path):
    path = tmp_path / "v3.sqlite"
    # A stray index in the way makes the step to version 4 fail half way.
    write_v3(path, "CREATE INDEX leases_state_released ON leases(kernel_id)")
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="could not be upgraded from schema version 3 to 4"):
        Ledger(path)
    assert path.read_bytes() == before
    assert "leases_state" in indexes(path)
    with sqlite3.connect(path) as raw, pytest.raises(sqlite3.DatabaseError, match="append-only"):
        raw.execute("DELETE FROM events WHERE lease_id = 'old'")
    raw.close()
