"""Recent usage in the arbiter: accrued by the planning transaction, kept in the ledger across a
restart and a schema upgrade, and shown in the status and in a waiting claim's reason."""

from __future__ import annotations

import asyncio
import math
import os
import sqlite3
from dataclasses import replace

import pytest

from conftest import FakeClock
from jupyter_gpusched.api.input import Claim
from jupyter_gpusched.api.views import Principal
from jupyter_gpusched.arbiter.local import LocalArbiter
from jupyter_gpusched.core import LeaseState, SchedConfig, new_claim
from jupyter_gpusched.core.usage import Accrued, recent
from jupyter_gpusched.devices.simulated import SimulatedBackend
from jupyter_gpusched.ledger import MIGRATIONS, SCHEMA_VERSION, Ledger
from jupyter_gpusched.ledger.rows import LEASE_COLUMNS, to_row

HOUR = 3600.0


def arbiter_on(path, state, clock, cfg) -> LocalArbiter:
    backend = SimulatedBackend(2, state_path=str(state))
    return LocalArbiter(cfg=cfg, ledger=Ledger(path), backend=backend, clock=clock)


async def claim(arb: LocalArbiter, user: str, kernel: str, count: int = 1) -> dict:
    result = await arb.claim(Principal(user=user), Claim(kernel_id=kernel, count=count))
    return result.lease


def write_v4(path, lease) -> None:
    """A schema-4 ledger as that version wrote it, holding ``lease``."""
    raw = sqlite3.connect(path)
    for step in MIGRATIONS[:4]:
        step(raw)
    # The columns version 4 had: those of version 5 come after it.
    kept = [i for i, name in enumerate(LEASE_COLUMNS) if name != "over_share_since"]
    names = ", ".join(f'"{LEASE_COLUMNS[i]}"' for i in kept)
    row = to_row(lease)
    marks = ", ".join("?" for _ in kept)
    raw.execute(f"INSERT INTO leases ({names}) VALUES ({marks})", [row[i] for i in kept])
    raw.execute("PRAGMA user_version = 4")
    raw.commit()
    raw.close()
    os.chmod(path, 0o600)


def test_a_version_4_ledger_gains_the_usage_table(tmp_path):
    path = tmp_path / "v4.sqlite"
    lease = replace(
        new_claim("old", "k-old", "alice", 10.0, groups=("ml",)),
        state=LeaseState.ACTIVE, devices=("GPU-0",), granted_at=11.0, version=1,
    )
    write_v4(path, lease)
    with Ledger(path) as led:
        assert led.schema_version == SCHEMA_VERSION == 5
        assert led.lease("old") == lease
        assert led.usage() == {}
        with led.transaction(100.0) as tx:
            tx.write_usage({"user:alice": Accrued(50.0, 1.0, 100.0), "group:ml": Accrued(50.0, 1.0, 100.0)})
        assert led.usage()["user:alice"] == Accrued(50.0, 1.0, 100.0)
        with led.transaction(200.0) as tx:
            tx.write_usage({"user:alice": Accrued(60.0, 0.0, 200.0)}, forgotten=["group:ml"])
        assert led.usage() == {"user:alice": Accrued(60.0, 0.0, 200.0)}
    # A file of this version opens as it is.
    with Ledger(path) as led:
        assert led.usage() == {"user:alice": Accrued(60.0, 0.0, 200.0)}


async def test_usage_survives_a_restart_and_orders_the_queue(tmp_path):
    path, state = tmp_path / "ledger.sqlite", tmp_path / "sim.sqlite"
    clock = FakeClock()
    cfg = SchedConfig(quotas={"*": 1}, usage_half_life=HOUR)
    first = arbiter_on(path, state, clock, cfg)
    await first.tick()
    held = await claim(first, "alice", "k-alice", count=2)
    assert held["state"] == "active"
    # alice holds both GPUs for one half-life: 2 GPUs * h / ln 2 * (1 - 1/2) GPU-seconds.
    clock.advance(HOUR)
    await first.tick()
    expected = 2 * HOUR / math.log(2) * 0.5
    assert recent(first.ledger.usage(), clock(), HOUR)["user:alice"] == pytest.approx(expected)
    await first.release(Principal(user="alice"), held["id"])
    first_record_after_release = first.ledger.usage()["user:alice"]
    await first.stop()
    first.close()

    # A new arbiter on the same ledger (a restart): alice's usage is still there, decaying.
    clock.advance(HOUR)
    again = arbiter_on(path, state, clock, cfg)
    await again.tick()
    # Released before the restart: from then on it only decays (the release settled it at once).
    assert first_record_after_release.held == 0
    assert recent(again.ledger.usage(), clock(), HOUR)["user:alice"] == pytest.approx(expected / 2, rel=1e-6)
    wall = await claim(again, "carol", "k-carol", count=2)
    assert wall["state"] == "active"
    alice = await claim(again, "alice", "k-alice-2")
    clock.advance(1)
    bob = await claim(again, "bob", "k-bob")
    assert (alice["state"], bob["state"]) == ("pending", "pending")
    status = await again.status(Principal(user="alice"))
    # bob asked later but used nothing lately: he is first.
    assert [q["user"] for q in status["queue"]] == ["bob", "alice"]
    reasons = {q["user"]: q["reason"] for q in status["queue"]}
    assert "1st in line: within quota; bob used no GPU time recently (half-life 1h00m)" in reasons["bob"]
    assert "2nd in line: within quota; alice used 0.7 GPU-hours recently" in reasons["alice"]
    assert "ahead of it: 1 claim of a user who used less of their quota recently" in reasons["alice"]
    mine = next(le for le in status["leases"] if le["id"] == alice["id"])
    assert mine["reason"].startswith("waiting for a GPU; 2nd in line")
    usage = {u["user"]: u for u in status["usage"]}
    assert usage["alice"]["gpu_hours"] == pytest.approx(expected / 2 / HOUR, abs=0.01)
    assert (usage["alice"]["quota"], usage["alice"]["held"]) == (1.0, 0.0)
    assert (usage["carol"]["held"], usage["bob"]["gpu_hours"]) == (2.0, 0.0)
    assert status["config"]["usage_half_life"] == HOUR
    await again.stop()
    again.close()


async def test_half_life_zero_tracks_nothing_and_orders_by_age(tmp_path):
    path, state = tmp_path / "ledger.sqlite", tmp_path / "sim.sqlite"
    clock = FakeClock()
    arb = arbiter_on(path, state, clock, SchedConfig(quotas={"*": 1}, usage_half_life=0))
    await arb.tick()
    held = await claim(arb, "alice", "k-alice", count=2)
    clock.advance(HOUR)
    await arb.tick()
    await arb.release(Principal(user="alice"), held["id"])
    await claim(arb, "carol", "k-carol", count=2)
    await claim(arb, "alice", "k-alice-2")
    clock.advance(1)
    await claim(arb, "bob", "k-bob")
    status = await arb.status(Principal(user="bob", admin=True))
    assert arb.ledger.usage() == {}
    assert (status["usage"], status["group_usage"]) == ([], [])
    assert [q["user"] for q in status["queue"]] == ["alice", "bob"]
    assert "GPU-hours" not in status["queue"][1]["reason"]
    assert "ahead of it: 1 claim of a user waiting longer" in status["queue"][1]["reason"]
    await arb.stop()
    arb.close()


async def test_status_hides_other_users_usage_like_their_leases(tmp_path):
    path, state = tmp_path / "ledger.sqlite", tmp_path / "sim.sqlite"
    clock = FakeClock()
    arb = arbiter_on(path, state, clock, SchedConfig())
    arb.show_holders = False
    await arb.tick()
    await arb.claim(Principal(user="alice", groups=("ml",)), Claim(kernel_id="k-a"))
    await arb.claim(Principal(user="bob", groups=("physics",)), Claim(kernel_id="k-b"))
    clock.advance(HOUR)
    await arb.tick()
    seen = await arb.status(Principal(user="alice", groups=("ml",)))
    assert sorted(u["user"] for u in seen["usage"]) == ["alice", "another user"]
    assert all(u["gpu_hours"] > 0.9 for u in seen["usage"])
    # Groups come from the leases (the claim's principal), and a group shows only to its members.
    assert [g["group"] for g in seen["group_usage"]] == ["ml"]
    admin = await arb.status(Principal(user="root", admin=True))
    assert sorted(u["user"] for u in admin["usage"]) == ["alice", "bob"]
    assert sorted(g["group"] for g in admin["group_usage"]) == ["ml", "physics"]
    assert all(g["held"] == 1.0 and g["gpu_hours"] > 0.9 for g in admin["group_usage"])
    await arb.stop()
    arb.close()
