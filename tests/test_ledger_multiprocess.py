"""Several real processes share one ledger file: grants stay exclusive, crashes lose nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

from jupyter_gpusched.core import Device, LeaseState
from jupyter_gpusched.ledger import Ledger, LedgerBusy, is_alive

WORKER = str(Path(__file__).with_name("ledger_worker.py"))
DEVICES = [Device(uuid=f"GPU-{i}", index=i) for i in range(4)]
WORKERS = 8
SECONDS = 20.0


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def holding_intervals(events):
    """Per device, (granted at, freed at, lease id, grant seq, free seq); freed None if still held."""
    open_: dict[tuple[str, str], tuple[float, int]] = {}
    out: dict[str, list] = defaultdict(list)
    for ev in events:
        for uuid in ev.devices:
            if ev.kind in ("grant", "restore"):
                open_[(uuid, ev.lease_id)] = (ev.at, ev.seq)
            elif ev.kind in ("release", "suspend"):
                at, seq = open_.pop((uuid, ev.lease_id))
                out[uuid].append((at, ev.at, ev.lease_id, seq, ev.seq))
    for (uuid, lease_id), (at, seq) in open_.items():
        out[uuid].append((at, None, lease_id, seq, None))
    return out


@pytest.mark.slow
def test_eight_processes_never_double_grant(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()  # created once, so that the workers race only for grants
    procs = []
    for n in range(WORKERS):
        out = tmp_path / f"worker-{n}.json"
        args = ("--worker", str(n), "--seconds", str(SECONDS), "--seed", str(n), "--out", str(out))
        procs.append((spawn("churn", str(path), *args), out))

    ledger = Ledger(path)
    deadline = time.time() + SECONDS + 60
    # While they run, every owner is alive (no false positives) and every snapshot is sound.
    while any(p.poll() is None for p, _ in procs) and time.time() < deadline:
        assert ledger.reap_dead_owners() == []
        assert ledger.check(DEVICES, history=False) == []
        time.sleep(1.0)
    for proc, _ in procs:
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
        assert proc.returncode == 0, output

    committed, abandoned = set(), set()
    for _, out in procs:
        result = json.loads(out.read_text())
        assert result["committed"], "every worker got through at least one claim"
        committed.update(result["committed"])
        abandoned.update(result["abandoned"])

    events = ledger.events()
    leases = {lease.id: lease for lease in ledger.leases(live_only=False)}
    owners = ledger.owners()

    # No device was ever held by two leases at once, in commit order...
    holders: dict[str, str] = {}
    for ev in events:
        for uuid in ev.devices:
            if ev.kind == "grant":
                assert uuid not in holders, f"{uuid} granted to {ev.lease_id} while {holders[uuid]} held it"
                holders[uuid] = ev.lease_id
            elif ev.kind == "release":
                assert holders.pop(uuid) == ev.lease_id
    # ...nor at overlapping times (each transaction takes its time once it holds the lock).
    for uuid, spans in holding_intervals(events).items():
        spans.sort(key=lambda s: s[3])
        for (_, freed, lease_id, _, _), (granted, _, next_id, _, _) in zip(spans, spans[1:]):
            assert freed is not None and freed <= granted, f"{uuid}: {lease_id} and {next_id} overlap"

    # Every lease is accounted for: committed ones are there, abandoned ones left no trace.
    assert set(leases) == committed
    assert not abandoned & {ev.lease_id for ev in events}
    assert not abandoned & set(owners)
    for lease_id, lease in leases.items():
        kinds = [ev.kind for ev in events if ev.lease_id == lease_id]
        if lease.state == LeaseState.RELEASED:
            assert kinds == ["claim", "grant", "release"], (lease_id, kinds)
        else:
            assert is_alive(owners[lease_id]), lease_id
    assert all(lease.state == LeaseState.RELEASED for lease in leases.values())

    # The workers really contended: some claims were granted by another process's pass.
    claimant = {ev.lease_id: ev.pid for ev in events if ev.kind == "claim"}
    assert any(ev.pid != claimant[ev.lease_id] for ev in events if ev.kind == "grant")
    assert any(len(ev.devices) == 2 for ev in events if ev.kind == "grant")

    assert ledger.check(DEVICES) == []
    ledger.close()


def wait_for(predicate, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while not predicate():
        if time.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.slow
def test_process_killed_inside_a_transaction(tmp_path):
    path = tmp_path / "ledger.sqlite"
    ready = tmp_path / "ready.json"
    proc = spawn("pause", str(path), "--ready", str(ready))
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 30, "the worker to pause")
        assert proc.poll() is None, proc.communicate()[0]
        ids = json.loads(ready.read_text())

        # The paused transaction holds the write lock.
        with Ledger(path, busy_timeout=0.2) as other, pytest.raises(LedgerBusy, match=str(path)):
            with other.transaction():
                pass

        os.kill(proc.pid, signal.SIGKILL)
        # Left unreaped on purpose: a zombie must count as dead.
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 10, "the worker to die")

        ledger = Ledger(path)
        first = ledger.lease(ids["committed"])
        assert first is not None and first.holding, "the committed claim and its grant survive"
        assert [ev.kind for ev in ledger.events(first.id)] == ["claim", "grant"]
        assert ledger.lease(ids["uncommitted"]) is None, "the write in flight is gone"
        assert ledger.events(ids["uncommitted"]) == []
        assert ids["uncommitted"] not in ledger.owners()
        assert any("gone" in p for p in ledger.check(DEVICES))

        reaped = ledger.reap_dead_owners()
        assert [lease.id for lease in reaped] == [first.id]
        assert ledger.leases() == [], "no lease is left without a living owner"
        assert ledger.events(first.id)[-1].kind == "release"
        assert "gone" in ledger.lease(first.id).reason
        assert ledger.check(DEVICES) == []
        with ledger.transaction() as tx:  # and the file takes writes again
            tx.set_drained("GPU-0", True, "after the crash")
        ledger.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
