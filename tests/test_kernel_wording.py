"""What a notebook shows while it waits for a GPU, as a user reads it: real kernels on a real
server with simulated GPUs.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace

import pytest
from conftest import api, live_lease

pytestmark = pytest.mark.slow

GiB = 1024**3


async def _until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _state(jp_fetch, lease_id: str, state: str):
    async def check() -> bool:
        code, lease = await api(jp_fetch, "leases", lease_id)
        return code == 200 and lease["state"] == state

    return check


def _holds(jp_fetch, arbiter, kernel_id: str, size: int):
    """Whether the server has seen ``kernel_id`` hold ``size`` bytes (a tick reads the GPUs)."""

    async def check() -> bool:
        await arbiter.tick()
        return (await live_lease(jp_fetch, kernel_id)).get("memory_held") == size

    return check


@pytest.fixture
def sched_config(sched_config):
    sched_config["simulated_devices"] = 1
    return sched_config


async def test_a_queued_restore_says_when_a_gpu_is_expected_and_its_restore_time_apart(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    out = await k1.execute("from jupyter_gpusched.devices import simulated\nsimulated.allocate('2GiB')\nmarker = 'kept'")
    assert out["error"] is None, out
    lease1 = await live_lease(jp_fetch, k1.id)
    await _until(_holds(jp_fetch, arbiter, k1.id, 2 * GiB), what="kernel 1's memory to be seen")

    # Another kernel asks for the only GPU; the idle first kernel is checkpointed for it.
    k2 = await start_kernel("gpu")
    code, _ = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2.id})
    assert code == 202
    clock.advance(120)
    await arbiter.tick()
    await _until(_state(jp_fetch, lease1["id"], "suspended"), what="kernel 1 to be checkpointed")
    out = await k2.execute("from jupyter_gpusched.devices import simulated\nsimulated.allocate('2GiB')")
    assert out["error"] is None, out
    lease2 = await live_lease(jp_fetch, k2.id)
    await _until(_holds(jp_fetch, arbiter, k2.id, 2 * GiB), what="kernel 2's memory to be seen")
    # The second kernel's state will not fit in what is left for checkpoints: a restart, announced.
    arbiter.cfg = replace(arbiter.cfg, checkpoint_host_memory=3 * GiB)

    resumed = asyncio.ensure_future(k1.execute("print(marker)", timeout=120))
    await _until(_state(jp_fetch, lease1["id"], "pending"), what="kernel 1 to queue for its restore")
    clock.advance(120)
    await arbiter.tick()
    await _until(_state(jp_fetch, lease2["id"], "reclaiming"), what="kernel 2's restart to be announced")
    await asyncio.sleep(5)  # the waiting line is refreshed at each of the claim's polls (3 s)
    clock.advance(61)
    await arbiter.tick()
    out1 = await resumed
    assert out1["error"] is None and "kept" in out1["stdout"], out1
    lines = [line for shown in out1["display"] for line in shown.splitlines()] + out1["stdout"].splitlines()

    waiting = [line for line in lines if line.startswith("Waiting for")]
    assert waiting, lines
    assert all(line.startswith("Waiting for a GPU to restore this kernel's GPU state: position 1 in the queue") for line in waiting)
    assert not any("onto:" in line for line in lines)
    # While the other kernel's restart counts down, the line says when the GPU should be free.
    assert any(
        re.search(r"GPU 0 is being taken back from another kernel: expected free in about \d+m\d\ds \(when its notice ends\)\.", line)
        for line in waiting
    ), waiting
    # The queue time and the restore's own time are told apart.
    assert any(re.fullmatch(r"Got GPU 0 after \d+s in the queue\.", line) for line in lines), lines
    restored = [line for line in lines if line.startswith("Restored")]
    assert len(restored) == 1 and re.fullmatch(
        r"Restored this kernel's GPU state onto GPU 0 \(the restore took \d+s\)\.", restored[0]
    ), restored
    took = int(re.search(r"took (\d+)s", restored[0]).group(1))
    assert took < 10, "the queue time is not counted as restore time"


async def test_a_wait_that_runs_out_says_so_once(jp_fetch, gpu_kernelspec, start_kernel, arbiter):
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    assert (await k1.execute("x = 1"))["error"] is None  # holds the only GPU, busy enough
    k2 = await start_kernel("gpu")
    out = await k2.execute("%gpu acquire --wait 3s", timeout=60)
    said = out["stdout"] + out["stderr"] + "\n".join(out["display"]) + (out["error"] or "")
    assert said.count("No GPU became free within") == 1, said
    assert "No GPU became free within 3s (this kernel was at position 1 in the queue). The request was withdrawn." in said
    assert "Stopped waiting for a GPU after 3s." in said


async def test_one_user_reads_of_their_own_kernels_not_of_someone_or_borrowing(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter
):
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    assert (await k1.execute("x = 1"))["error"] is None  # holds the only GPU
    out = await k1.execute("%gpu")
    said = out["stdout"] + "\n".join(out["display"])
    idle = [line for line in said.splitlines() if line.startswith("Idle:")]
    assert idle and idle[0].endswith("idle if another of your kernels waits."), said
    assert "someone waits" not in said

    k2 = await start_kernel("gpu")
    code, _ = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2.id})
    assert code == 202
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    (entry,) = status["queue"]
    assert (
        f"1st in line: every GPU is held by other kernels of {status['user']}, the only user here; "
        "it gets the first they give back" in entry["reason"]
    ), entry["reason"]
    assert "borrow" not in entry["reason"]


async def test_gpu_status_and_acquire_show_a_few_readable_lines_and_stay_dicts(
    jp_fetch, gpu_kernelspec, start_kernel
):
    gpu_kernelspec("gpu", gpus=0)
    kernel = await start_kernel("gpu")
    out = await kernel.execute("from jupyter_gpusched import gpu\nlease = gpu.acquire()\nlease")
    assert out["error"] is None, out
    assert out["display"][-1] == "<GPU lease: This kernel holds GPU 0 (1 GPU, exclusive): active.>", out

    out = await kernel.execute("status = gpu.status()\nstatus")
    assert out["error"] is None, out
    shown = out["display"][-1]
    lines = shown.splitlines()
    assert lines[0] == "This kernel holds GPU 0 (1 GPU, exclusive): active.", shown
    assert len(lines) <= 10 and "'memory_total'" not in shown and "is_admin" not in shown, shown
    # The dict is all there.
    out = await kernel.execute(
        "print(status['lease']['state'], lease['devices'] == status['lease']['devices'], len(status['devices']),"
        " lease.state, isinstance(status, dict))"
    )
    assert out["stdout"].strip() == "active True 1 active True", out


async def _second_kernel_queues(jp_fetch, gpu_kernelspec, start_kernel):
    """Kernel 1 holds the only GPU; kernel 2's ``%gpu acquire`` waits in the queue. Returns kernel
    2, its running cell, its pending claim and a check that lists its pending claims."""
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    assert (await k1.execute("x = 1"))["error"] is None  # holds the only GPU
    k2 = await start_kernel("gpu")
    waiting = asyncio.ensure_future(k2.execute("%gpu acquire", timeout=60))

    async def pending():
        code, leases = await api(jp_fetch, "leases", params={"kernel_id": k2.id})
        return [le for le in leases if le["state"] == "pending"]

    (claim,) = await _until(pending, what="kernel 2 to queue")
    await asyncio.sleep(1)
    return k2, waiting, claim, pending


async def test_a_wait_cancelled_from_the_sidebar_says_so_in_one_line(jp_fetch, gpu_kernelspec, start_kernel):
    k2, waiting, claim, pending = await _second_kernel_queues(jp_fetch, gpu_kernelspec, start_kernel)
    # What the sidebar's cancel does: the user releases the pending lease.
    assert (await api(jp_fetch, "leases", claim["id"], method="DELETE"))[0] == 204
    out = await waiting
    assert out["error"] is None, out  # the user cancelled it: not an error in the notebook
    final = out["display"][-1]
    assert final.startswith("Stopped waiting: this kernel's request for a GPU was cancelled by ")
    assert final.endswith("from outside this notebook (the GPU sidebar or the command line). Run `%gpu acquire` to ask again.")
    said = "\n".join(out["display"]) + out["stdout"] + out["stderr"]
    assert claim["id"] not in said and "GPUSchedError" not in said and "no longer lists" not in said, said
    # The next cell does not ask again by itself, and says nothing more about it.
    out = await k2.execute("y = 2")
    assert out["error"] is None and not out["display"] and not out["stdout"], out
    assert not await pending()


async def test_a_wait_the_server_ends_says_the_servers_reason_not_a_cancel(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter
):
    k2, waiting, claim, pending = await _second_kernel_queues(jp_fetch, gpu_kernelspec, start_kernel)
    # The server ends the claim itself (as when the kernel's process is gone, or a restore fails).
    from jupyter_gpusched import core

    lease = next(le for le in arbiter.state.leases if le.id == claim["id"])
    await arbiter.update(lease, lambda cur, now: core.released(cur, now, "released: the GPU it waited for was lost"))
    out = await waiting
    said = "\n".join(out["display"]) + out["stdout"] + out["stderr"] + str(out["error"] or "")
    assert "the GPU it waited for was lost" in said, out
    assert "cancelled" not in said and "GPU sidebar" not in said, said


async def test_a_gpu_taken_back_while_idle_says_so(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock, monkeypatch
):
    monkeypatch.setenv("JUPYTER_GPUSCHED_POLL", "60")  # the next cell, not the watcher, reads the change
    clock = use_clock
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    assert (await k1.execute("x = 1"))["error"] is None  # holds the only GPU, and no GPU memory
    lease1 = await live_lease(jp_fetch, k1.id)
    k2 = await start_kernel("gpu")
    code, _ = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2.id})
    assert code == 202
    clock.advance(120)
    taken_back = _state(jp_fetch, lease1["id"], "released")

    async def ticked_and_taken_back():
        await arbiter.tick()  # the pass that sees kernel 1 idle, then the one that takes it back
        return await taken_back()

    await _until(ticked_and_taken_back, what="kernel 1's lease to be taken back")
    lease2 = await live_lease(jp_fetch, k2.id)
    assert (await api(jp_fetch, "leases", lease2["id"], method="DELETE"))[0] == 204  # free for k1 again
    out = await k1.execute("z = 3", timeout=60)
    said = "\n".join(out["display"]) + out["stdout"]
    assert (
        "GPU taken back while this kernel was idle: GPU 0: it held no GPU memory, so nothing was lost. "
        "This kernel asks for a GPU again before its next cell runs." in said
    ), said
    assert "no longer lists" not in said
