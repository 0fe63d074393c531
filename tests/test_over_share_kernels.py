"""A shared lease's kernel goes over its memory share: real kernels on one simulated GPU.

The kernel allocates simulated GPU memory beyond its share (``simulated.allocate``, which the
backend reports per process as NVML does); the server tells it, asks it to drop its frameworks'
caches, and, as that frees nothing (the memory is the kernel's own, not a cache) while another
kernel shares the GPU, restarts it after the grace period. The neighbour keeps its GPU.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from conftest import api, live_lease

pytestmark = pytest.mark.slow

ALLOC = "from jupyter_gpusched.devices import simulated; simulated.allocate('{}')"
HEAD = "over its memory share: its processes hold more than the 16.0 GiB it claimed on GPU 0"


@pytest.fixture
def one_gpu(sched_config):
    sched_config["simulated_devices"] = 1


async def _until(check, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def _lease(jp_fetch, lease_id: str) -> dict:
    code, lease = await api(jp_fetch, "leases", lease_id)
    assert code == 200
    return lease


async def test_a_kernel_over_its_share_is_told_then_its_caches_dropped_then_it_is_restarted(
    one_gpu, jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    notices: list[dict] = []
    reasons: list[str] = []  # the reasons lease1 was written with, in order

    def listen(event):
        if event.type == "notice":
            notices.append(event.notice)
        elif event.type == "lease" and event.lease is not None and event.lease.kernel_id == k1.id:
            reasons.append(event.lease.reason)

    arbiter.subscribe(listen)
    gpu_kernelspec("shared", mode="shared", memory="16GiB")
    k1 = await start_kernel("shared")
    k2 = await start_kernel("shared")
    assert (await k1.execute(ALLOC.format("4GiB")))["error"] is None
    assert (await k2.execute(ALLOC.format("2GiB")))["error"] is None
    lease1, lease2 = await live_lease(jp_fetch, k1.id), await live_lease(jp_fetch, k2.id)
    assert lease1["devices"] == lease2["devices"], "both shares on the one GPU"
    await arbiter.tick()
    assert (await _lease(jp_fetch, lease1["id"]))["over_share_since"] is None

    # Alice's kernel takes 20 GiB in all: over its 16 GiB share.
    assert (await k1.execute(ALLOC.format("16GiB")))["error"] is None
    await arbiter.tick()
    got = await _lease(jp_fetch, lease1["id"])
    assert got["memory_held"] == 20 * 1024**3
    assert got["over_share_since"] is not None
    assert got["reason"] == f"{HEAD}; its framework caches are dropped if it stays over"
    told = [n for n in notices if n["kind"] == "over_share" and n["lease_id"] == lease1["id"]]
    assert [n["message"] for n in told] == [got["reason"]]
    said = await k1.execute("%gpu status")
    text = said["stdout"] + "\n".join(said["display"])
    assert "uses 20.0 GiB of its 16.0 GiB share (over it)" in text
    assert f"It is {HEAD}" in text

    # A second later, still over: the free-cache step, which the kernel's agent serves.
    clock.advance(2)
    await arbiter.tick()
    assert any(n["kind"] == "free_cache" and n["lease_id"] == lease1["id"] for n in notices)

    async def countdown():
        lease = await _lease(jp_fetch, lease1["id"])
        return lease if lease["reclaim_step"] == "restart" else None

    # The kernel answers (the server's ticks go on meanwhile); still over, and Bob's kernel
    # shares the GPU: a restart after the grace period.
    got = await _until(countdown, "the kernel to answer the free-cache step, then the restart's notice")
    step = reasons.index(f"{HEAD}; dropping its framework caches")
    assert "the kernel had no framework cache to drop" in reasons[step:]
    assert got["state"] == "reclaiming"
    assert got["reason"] == (
        f"{HEAD}; dropping its framework caches did not bring it within its share and another lease "
        "shares its GPU, so the kernel will be restarted after a 1m00s notice unless it frees GPU memory"
    )
    assert any(n["kind"] == "reclaim_warning" and n["lease_id"] == lease1["id"] for n in notices)
    # A keep does not call it off.
    code, kept = await api(jp_fetch, "leases", lease1["id"], "keep", method="POST", body={"seconds": 600})
    assert code == 200 and kept["state"] == "reclaiming"

    clock.advance(61)
    await arbiter.tick()

    async def released():
        lease = await _lease(jp_fetch, lease1["id"])
        return lease if lease["state"] == "released" else None

    gone = await _until(released, "the over-share restart")
    assert gone["reason"].startswith("reclaimed: the kernel was restarted to free its GPU: " + HEAD)
    assert any(n["kind"] == "reclaimed" and n["lease_id"] == lease1["id"] for n in notices)
    # Bob's kernel keeps its GPU, and its memory.
    await arbiter.tick()
    mine = await live_lease(jp_fetch, k2.id)
    assert mine["id"] == lease2["id"] and mine["state"] in ("active", "idle")
    assert mine["devices"] == lease2["devices"] and mine["memory_held"] == 2 * 1024**3
    assert not any(n["lease_id"] == lease2["id"] and n["kind"] in ("over_share", "reclaim_warning") for n in notices)

    # Alice's kernel was restarted, not shut down: it runs again, holding nothing.
    async def restarted():
        kernel = arbiter.kernels.km.get_kernel(k1.id)
        if kernel is not None and not kernel.ready.done():
            return None
        response = await jp_fetch("api", "kernels", k1.id)
        return json.loads(response.body)["execution_state"] == "idle"

    await _until(restarted, "the restarted kernel")


async def test_freeing_the_memory_in_time_calls_the_restart_off(
    one_gpu, jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    gpu_kernelspec("shared", mode="shared", memory="16GiB")
    k1 = await start_kernel("shared")
    k2 = await start_kernel("shared")
    await k2.execute(ALLOC.format("1GiB"))
    assert (await k1.execute(ALLOC.format("20GiB")))["error"] is None
    lease1 = await live_lease(jp_fetch, k1.id)
    await arbiter.tick()
    clock.advance(2)
    await arbiter.tick()

    async def countdown():
        await arbiter.tick()
        lease = await _lease(jp_fetch, lease1["id"])
        return lease if lease["reclaim_step"] == "restart" else None

    await _until(countdown, "the restart to be announced")
    # The user frees what was too much: the kernel's own cell, while the countdown runs.
    out = await k1.execute("from jupyter_gpusched.devices import simulated; simulated.free('10GiB')")
    assert out["error"] is None, out
    await arbiter.tick()
    got = await _lease(jp_fetch, lease1["id"])
    assert got["state"] == "active" and got["reclaim_step"] is None and got["over_share_since"] is None
    assert got["reason"] == "back within its memory share: the restart is off"
    clock.advance(120)
    await arbiter.tick()
    assert (await _lease(jp_fetch, lease1["id"]))["state"] in ("active", "idle")
