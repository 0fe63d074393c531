"""The arbiter's view of the leases after a planning pass that raced with a write.

A pass reads the ledger in one transaction and applies its plan afterwards; a reclaim step (a
checkpoint that suspends a lease, an idle release) may write a lease in between. What the server
shows, and what it acts on next (restoring checkpoints it believes orphaned, say), must be that
later write, not the pass's older copy.
"""

from __future__ import annotations

from dataclasses import replace

from conftest import FakeClock
from jupyter_gpusched import core
from jupyter_gpusched.api.views import Principal
from jupyter_gpusched.core import SchedConfig
from test_arbiter_usage import arbiter_on, claim


async def test_a_lease_written_while_a_pass_plans_stays_as_written(tmp_path):
    clock = FakeClock()
    arb = arbiter_on(tmp_path / "ledger.sqlite", tmp_path / "sim.sqlite", clock, SchedConfig())
    await arb.tick()
    alice = await claim(arb, "alice", "k-alice")
    bob = await claim(arb, "bob", "k-bob")
    assert alice["state"] == bob["state"] == "active"

    apply = arb._apply

    async def written_before_apply(planned):
        # The pass has planned (its transaction is over); a reclaim step writes now.
        await arb.update(arb.live_lease(alice["id"]), lambda cur, now: replace(cur, reason="suspended meanwhile"))
        await arb.update(arb.live_lease(bob["id"]), lambda cur, now: core.released(cur, now, "released meanwhile"))
        await apply(planned)

    arb._apply = written_before_apply
    clock.advance(1)
    await arb.tick()
    arb._apply = apply

    status = await arb.status(Principal(user="admin", admin=True))
    shown = {le["id"]: le for le in status["leases"]}
    assert shown[alice["id"]]["reason"] == "suspended meanwhile"
    assert bob["id"] not in shown, "a lease released during the pass is not shown live again"
    assert [d["lease_ids"] for d in status["devices"]].count([]) == 1, status["devices"]

    # The next pass reads the ledger again and agrees.
    clock.advance(1)
    await arb.tick()
    again = {le["id"]: le for le in (await arb.status(Principal(user="admin", admin=True)))["leases"]}
    assert again.keys() == shown.keys() and again[alice["id"]]["reason"] == "suspended meanwhile"
    await arb.stop()
    arb.close()
