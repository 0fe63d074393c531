"""Acceptance: a kernel that comes back within seconds keeps its GPU through a pause, and a claim
that must queue is seen at once on the events websocket.

A real jupyter_server with the extension on one simulated GPU (hybrid, idle_timeout 20 s,
release_timeout 3600 s) and real ipykernel kernels started through gpusched-provisioner. The
server's clock is a fake one that the test moves, so the pauses take no wall time; the kernels run
their cells for real and the server watches them as it always does.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from conftest import api, live_lease

pytestmark = pytest.mark.slow

GiB = 1024**3


@pytest.fixture
def sched_config(sched_config):
    sched_config.update(simulated_devices=1, policy="hybrid", idle_timeout=20.0, release_timeout=3600.0)
    return sched_config


_lease_of = live_lease


async def _events(ws, until: float) -> list[dict]:
    """Everything the events websocket sends before the monotonic time ``until``."""
    seen = []
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return seen
        try:
            raw = await asyncio.wait_for(ws.read_message(), left)
        except asyncio.TimeoutError:
            return seen
        if raw is None:
            return seen
        seen.append(json.loads(raw))


async def test_short_pauses_keep_the_gpu_through_a_long_one_and_a_new_claim_is_seen_queueing(
    jp_fetch, jp_ws_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")

    # Six short cells 2 s apart; the first binds the GPU and puts 2 GiB on it.
    out = await k1.execute("from jupyter_gpusched.devices import simulated\nsimulated.allocate('2GiB')")
    assert out["error"] is None, out
    for i in range(5):
        clock.advance(2)
        await arbiter.tick()
        out = await k1.execute(f"x = {i}")
        assert out["error"] is None, out
        await arbiter.tick()
    lease = await _lease_of(jp_fetch, k1.id)
    assert lease["memory_held"] == 2 * GiB
    assert len(arbiter.ledger.lease(lease["id"]).gaps) >= 4, "the kernel's pauses were seen"

    # A 45 s pause with nobody waiting: past idle_timeout the lease counts idle, and that is all.
    states = set()
    for _ in range(9):
        clock.advance(5)
        await arbiter.tick()
        await asyncio.sleep(0.1)
        states.add((await api(jp_fetch, "leases", lease["id"]))[1]["state"])
    assert states <= {"active", "idle"}, f"the lease went through {states} with nobody waiting"
    got = (await api(jp_fetch, "leases", lease["id"]))[1]
    assert got["state"] == "idle" and got["devices"] == lease["devices"]
    _, status = await api(jp_fetch, "status")
    assert status["devices"][0]["memory_used"] == 2 * GiB, "the kernel's GPU memory stayed on the GPU"
    out = await k1.execute("print(simulated.memory_allocated())")
    assert out["stdout"].strip() == str(2 * GiB), out

    # A second kernel's claim must queue; the events websocket says so within a second.
    ws = await jp_ws_fetch("api", "gpusched", "events")
    first = json.loads(await asyncio.wait_for(ws.read_message(), 10))
    assert first["type"] == "snapshot"
    k2 = await start_kernel("gpu")
    code, claim = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2.id})
    asked = time.monotonic()
    assert code == 202 and claim["state"] == "pending" and claim["position"] == 1, claim
    seen = await _events(ws, asked + 1.0)
    ws.close()
    pending = [e for e in seen if e["type"] == "lease" and e["lease"]["id"] == claim["id"]]
    assert pending and pending[-1]["lease"]["state"] == "pending", seen
    queued = [e for e in seen if e["type"] == "notice" and e["kind"] == "queued"]
    assert queued and queued[0]["lease_id"] == claim["id"] and queued[0].get("position") == 1, seen
    await k1.close()
    await k2.close()
