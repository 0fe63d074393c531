"""End to end: real ipykernel kernels, started through gpusched-provisioner, on 2 simulated GPUs.

The server's clock is a fake one that the test moves, so no test sleeps through an idle timeout;
the kernels themselves run for real and talk to the server over HTTP.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import api, live_lease

pytestmark = pytest.mark.slow

UUIDS = "import os; print('VISIBLE=' + os.environ['CUDA_VISIBLE_DEVICES'])"


def _visible(out: dict) -> str:
    for line in out["stdout"].splitlines():
        if line.startswith("VISIBLE="):
            return line.split("=", 1)[1]
    raise AssertionError(f"no CUDA_VISIBLE_DEVICES printed: {out}")


_lease_of = live_lease


async def _until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def test_kernels_share_two_gpus_through_idle_reclaim(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    k2 = await start_kernel("gpu")

    # Lazy binding: each kernel's first real cell gets its own GPU, visible to CUDA as its UUID.
    out1 = await k1.execute(UUIDS)
    out2 = await k2.execute(UUIDS)
    assert out1["error"] is None and out2["error"] is None, (out1, out2)
    gpu1, gpu2 = _visible(out1), _visible(out2)
    assert gpu1 and gpu2 and gpu1 != gpu2
    lease1 = await _lease_of(jp_fetch, k1.id)
    lease2 = await _lease_of(jp_fetch, k2.id)
    assert lease1["devices"] == [gpu1] and lease2["devices"] == [gpu2]

    # Kernel 1 puts data on its GPU; kernel 2 never touches its GPU.
    out = await k1.execute(
        "from jupyter_gpusched.devices import simulated\n"
        "simulated.allocate('2GiB')\n"
        "marker = 'state kept'\n"
        "print('ALLOCATED', simulated.memory_allocated())"
    )
    assert out["error"] is None, out
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    held = {d["uuid"]: d["memory_used"] for d in status["devices"]}
    assert held[gpu1] == 2 * 1024**3

    # A third kernel asks and waits in the queue with its position.
    k3 = await start_kernel("gpu")
    acquiring = asyncio.ensure_future(k3.execute("%gpu acquire\n" + UUIDS, timeout=120))

    async def k3_pending():
        code, leases = await api(jp_fetch, "leases", params={"kernel_id": k3.id})
        return [le for le in leases if le["state"] == "pending"]

    pending = await _until(k3_pending, what="kernel 3 to queue")
    assert pending[0]["position"] == 1
    assert not acquiring.done()

    # Kernel 2 stays busy; kernel 1 goes idle past the contended threshold.
    busy = asyncio.ensure_future(k2.execute("import time; time.sleep(4)", timeout=60))
    await asyncio.sleep(1.0)
    clock.advance(120)
    await arbiter.tick()

    # Kernel 1 held GPU memory, so the ladder checkpoints it rather than killing it.
    await _until(
        lambda: _state_is(jp_fetch, lease1["id"], "suspended"), what="kernel 1 to be suspended"
    )
    out3 = await acquiring
    assert out3["error"] is None, out3
    assert "position 1" in " ".join(out3["display"]) + out3["stdout"]
    assert _visible(out3) == gpu1
    lease3 = await _lease_of(jp_fetch, k3.id)
    assert lease3["devices"] == [gpu1]
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    held = {d["uuid"]: d["memory_used"] for d in status["devices"]}
    assert held[gpu1] == 0, "the checkpoint freed the GPU completely"
    await busy

    # Kernel 1's next cell asks for its GPU back. Kernel 3 computes; kernel 2 idles (it holds no
    # memory, so it is simply released) and kernel 1 is restored onto kernel 2's GPU, another GPU
    # of the same model, with its data intact.
    busy3 = asyncio.ensure_future(k3.execute("import time; time.sleep(5)", timeout=60))
    await asyncio.sleep(1.0)
    resumed = asyncio.ensure_future(
        k1.execute(UUIDS + "\nprint(marker, simulated.memory_allocated())", timeout=120)
    )
    await _until(lambda: _state_is(jp_fetch, lease1["id"], "pending"), what="kernel 1 to queue")
    clock.advance(120)
    await arbiter.tick()
    out1 = await resumed
    assert out1["error"] is None, out1
    assert _visible(out1) in (gpu1, gpu2)
    assert "state kept 2147483648" in out1["stdout"]
    lease1 = await _lease_of(jp_fetch, k1.id)
    assert lease1["state"] == "active" and lease1["devices"] == [gpu2]
    got2 = (await api(jp_fetch, "leases", lease2["id"]))[1]
    assert got2["state"] == "released" and "no GPU memory" in got2["reason"]
    assert arbiter.ledger.check() == []
    await busy3

    # Kernel 2's next cell binds again and waits its turn: nothing is free, so --no-wait says so.
    out2 = await k2.execute("%gpu acquire --no-wait")
    assert "position" in (out2["stdout"] + " ".join(out2["display"]))


async def _state_is(jp_fetch, lease_id: str, state: str) -> bool:
    code, lease = await api(jp_fetch, "leases", lease_id)
    return code == 200 and lease["state"] == state


async def test_launch_binding_and_restart_keeps_the_lease(jp_fetch, gpu_kernelspec, start_kernel, arbiter):
    gpu_kernelspec("gpu-launch", bind="launch")
    k = await start_kernel("gpu-launch")
    lease = await _lease_of(jp_fetch, k.id)
    assert lease["state"] == "active"
    out = await k.execute(UUIDS)
    assert _visible(out) == lease["devices"][0]

    await jp_fetch("api", "kernels", k.id, "restart", method="POST", body="")
    await k.close()
    await k.connect()
    out = await k.execute(UUIDS, timeout=60)
    assert _visible(out) == lease["devices"][0]
    after = await _lease_of(jp_fetch, k.id)
    assert after["id"] == lease["id"] and after["state"] in ("active", "idle")

    await jp_fetch("api", "kernels", k.id, method="DELETE")
    await arbiter.tick()
    code, gone = await api(jp_fetch, "leases", lease["id"])
    assert gone["state"] == "released"


async def test_restart_fallback_is_announced_then_carried_out(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock, sched_config
):
    """Without checkpoints the fallback restarts the idle kernel, after a notice."""
    arbiter.caps = type(arbiter.caps)(checkpoint=False, checkpoint_reason="checkpoint is off")
    notices = []
    arbiter.subscribe(lambda event: notices.append(event.notice) if event.type == "notice" else None)
    clock = use_clock
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    k2 = await start_kernel("gpu")
    await k1.execute("from jupyter_gpusched.devices import simulated; simulated.allocate('1GiB')")
    await k2.execute("from jupyter_gpusched.devices import simulated; simulated.allocate('1GiB')")
    lease1 = await _lease_of(jp_fetch, k1.id)
    k3 = await start_kernel("gpu")
    code, _ = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k3.id})
    assert code == 202
    busy = asyncio.ensure_future(k2.execute("import time; time.sleep(3)", timeout=60))
    await asyncio.sleep(0.5)
    clock.advance(120)
    await arbiter.tick()
    got = (await api(jp_fetch, "leases", lease1["id"]))[1]
    assert got["state"] == "reclaiming" and got["reclaim_step"] == "restart"
    assert any(n["kind"] == "reclaim_warning" and n["kernel_id"] == k1.id for n in notices)

    # Keeping it calls the reclaim off.
    code, kept = await api(jp_fetch, "leases", lease1["id"], "keep", method="POST", body={"seconds": 60})
    assert code == 200 and kept["state"] != "reclaiming"
    clock.advance(200)
    await arbiter.tick()
    got = (await api(jp_fetch, "leases", lease1["id"]))[1]
    assert got["state"] == "reclaiming"
    clock.advance(61)
    await arbiter.tick()
    await _until(lambda: _state_is(jp_fetch, lease1["id"], "released"), what="the restart")
    code, lease3 = await api(jp_fetch, "leases", params={"kernel_id": k3.id})
    await arbiter.tick()
    assert (await _lease_of(jp_fetch, k3.id))["state"] == "active"
    await busy


async def test_a_kernel_showing_only_the_panel_is_still_reclaimed_as_idle(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    out = await k1.execute(UUIDS)
    lease1 = await _lease_of(jp_fetch, k1.id)
    out = await k1.execute("%gpu panel")
    assert out["error"] is None, out
    k2 = await start_kernel("gpu")
    # Kernel 2 computes all along (on a loaded machine the steps below take longer than they say),
    # so that the panel kernel is the only idle one.
    busy = asyncio.ensure_future(k2.execute("import time; time.sleep(15)", timeout=60))
    k3 = await start_kernel("gpu")
    code, pending = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k3.id})
    assert code == 202

    # Time passes while the panel keeps refreshing (HTTP polls, widget updates on the comm
    # channel). Were any of that counted as running code, the idle clock would restart at every
    # step and never reach the contended threshold (60 s).
    for _ in range(4):
        clock.advance(30)
        await asyncio.sleep(2.5)
        await arbiter.tick()
    await _until(lambda: _state_is(jp_fetch, lease1["id"], "released"), what="the panel kernel's reclaim")
    await arbiter.tick()
    assert (await _lease_of(jp_fetch, k3.id))["devices"] == lease1["devices"]
    await busy
