"""The arbiter prunes released leases past history_days from its ledger, and nothing live."""

from __future__ import annotations

import json

import pytest

from conftest import api
from jupyter_gpusched.arbiter.local import PRUNE_EVERY


@pytest.fixture
def sched_config(sched_config):
    sched_config["release_timeout"] = 0.0  # an idle lease with nobody waiting is kept: live for a month
    return sched_config


async def _kernel(jp_fetch) -> str:
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    return json.loads(r.body)["id"]


async def test_released_leases_leave_the_ledger_after_history_days(jp_fetch, arbiter, use_clock):
    assert arbiter.history_days == 30  # the default
    k1, k2 = await _kernel(jp_fetch), await _kernel(jp_fetch)
    _, old = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1})
    _, live = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2})
    assert (await api(jp_fetch, "leases", old["id"], method="DELETE"))[0] == 204

    use_clock.advance(29 * 86400)
    await arbiter.tick()
    assert arbiter.ledger.lease(old["id"]) is not None, "29 days: still there"

    use_clock.advance(2 * 86400 + PRUNE_EVERY)
    await arbiter.tick()
    assert arbiter.ledger.lease(old["id"]) is None, "31 days after its release it is gone"
    assert arbiter.ledger.events(old["id"]) == []
    code, kept = await api(jp_fetch, "leases", live["id"])
    assert code == 200 and kept["state"] in ("active", "idle"), "a live lease is never pruned, whatever its age"
    assert arbiter.ledger.check() == []
    assert (await api(jp_fetch, "leases", old["id"]))[0] == 404
