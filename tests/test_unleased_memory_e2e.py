"""Issue 21, item 2, replayed: memory that a kernel keeps after `%gpu release` counts as taken.

A real jupyter_server with the extension on two simulated 80 GiB GPUs and real ipykernel kernels.
Kernel A holds 8 GiB on GPU 0 and runs `%gpu release`: it is told that its memory stays behind
and what to do about it. Another kernel's exclusive claim is then not given GPU 0 while that
memory is there (it waits, and says why); `%gpu status` and the devices' JSON name the process
outside any lease. The REST release says the same in its answer, and can keep the lease instead.
"""

from __future__ import annotations

import pytest

from conftest import api
from test_e2e_kernels import _lease_of, _until

pytestmark = pytest.mark.slow

GiB = 1024**3
SIM = "from jupyter_gpusched.devices import simulated\n"


def _said(out: dict) -> str:
    return out["stdout"] + " ".join(out["display"]) + str(out["error"] or "")


async def _device(jp_fetch, index: int) -> dict:
    _, devices = await api(jp_fetch, "devices")
    return next(d for d in devices if d["index"] == index)


async def test_memory_kept_after_release_is_told_counted_as_taken_and_named(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter
):
    gpu_kernelspec("gpu")
    a = await start_kernel("gpu")
    out = await a.execute(SIM + "simulated.allocate('8GiB')")
    assert out["error"] is None, out
    lease_a = await _lease_of(jp_fetch, a.id)
    assert lease_a["device_indices"] == [0], lease_a

    c = await start_kernel("gpu")
    out = await c.execute(SIM + "simulated.allocate('4GiB')")
    assert out["error"] is None, out
    lease_c = await _lease_of(jp_fetch, c.id)
    assert lease_c["device_indices"] == [1], lease_c
    await arbiter.tick()

    # A releases while it holds 8 GiB: released, and told that its memory stays behind.
    out = await a.execute("%gpu release")
    said = _said(out)
    assert out["error"] is None, out
    pid_a = arbiter.kernels.kernel_pid(a.id)
    assert "Released GPU 0" in said, said
    assert f"This kernel's processes still hold 8.0 GiB of GPU memory on GPU 0 (pid {pid_a})" in said, said
    assert "It stays counted as taken there" in said, said
    assert "then run %gpu release --free" in said and "Or keep it" in said, said
    await arbiter.tick()

    # GPU 0 has no lease now, but B's exclusive claim for a whole GPU is not placed beside A's memory.
    b = await start_kernel("gpu")
    out = await b.execute("%gpu acquire --no-wait")
    assert out["error"] is None, out
    lease_b = await _lease_of(jp_fetch, b.id)
    assert lease_b["state"] == "pending", lease_b
    assert lease_b["devices"] == [], lease_b
    assert "processes outside any lease hold 8.0 GiB on GPU 0" in lease_b["reason"], lease_b

    # The views name the process: the devices' JSON, and `%gpu status` in B.
    gpu0 = await _device(jp_fetch, 0)
    assert gpu0["lease_ids"] == [] and gpu0["memory_used"] == 8 * GiB, gpu0
    assert [(p["pid"], p["lease_id"], p["memory_used"], p["kernel_id"]) for p in gpu0["processes"]] == [
        (pid_a, None, 8 * GiB, a.id)
    ], gpu0
    # A server of one user names no user (every kernel is its user's).
    assert gpu0["processes"][0]["user"] is None, gpu0
    out = await b.execute("%gpu status")
    said = _said(out)
    assert "GPU processes outside any lease (their memory counts as taken):" in said, said
    assert f"GPU 0: pid {pid_a}, a kernel, 8.0 GiB" in said, said

    # The REST release of C, which holds 4 GiB: kept when asked to keep it, else released, and
    # both answers say what C's kernel holds.
    code, answer = await api(jp_fetch, "leases", lease_c["id"], method="DELETE", params={"memory_held": "keep"})
    assert code == 200 and answer["released"] is False, (code, answer)
    assert answer["memory_held"] == 4 * GiB and answer["lease"]["state"] == "active", answer
    assert [p["device_index"] for p in answer["processes"]] == [1], answer
    assert answer["message"].startswith(f"Lease {lease_c['id']} is kept"), answer
    code, answer = await api(jp_fetch, "leases", lease_c["id"], method="DELETE", params={"memory_held": "sometimes"})
    assert code == 400 and "memory_held must be 'release'" in answer["message"], answer
    assert (await _lease_of(jp_fetch, c.id))["state"] == "active"
    code, answer = await api(jp_fetch, "leases", lease_c["id"], method="DELETE")
    assert code == 200 and answer["released"] is True and answer["lease"]["state"] == "released", answer
    assert "4.0 GiB" in answer["message"] and "counts as taken on GPU 1" in answer["message"], answer
    await arbiter.tick()
    assert (await _lease_of(jp_fetch, b.id))["state"] == "pending"

    # A frees its memory: B's claim is granted GPU 0 at the next pass.
    out = await a.execute("simulated.free()")
    assert out["error"] is None, out

    async def granted():
        await arbiter.tick()
        lease = await _lease_of(jp_fetch, b.id)
        return lease if lease["state"] == "active" else None

    await _until(granted, what="B to be granted GPU 0 once A's memory is freed")
    assert (await _lease_of(jp_fetch, b.id))["device_indices"] == [0]


async def test_a_kernel_that_released_with_its_memory_gets_that_gpu_back(jp_fetch, gpu_kernelspec, start_kernel, arbiter):
    """The kernel's own memory outside its lease does not keep its own claim off that GPU, and
    that GPU comes first for it (CUDA in the kernel may be initialized there)."""
    gpu_kernelspec("gpu")
    a = await start_kernel("gpu")
    out = await a.execute(SIM + "simulated.allocate('8GiB')\n%gpu release")
    assert out["error"] is None, out
    await arbiter.tick()
    out = await a.execute("%gpu acquire --no-wait")
    assert out["error"] is None and "This kernel holds GPU 0" in _said(out), out
