"""Acceptance: on simulated GPUs of two models, a checkpointed kernel is restored only onto a GPU
of the model it came from, however long it waits, with a reason that says so.

A real jupyter_server with the extension and real ipykernel kernels; the simulated checkpointer
can restore onto another GPU (of the same model), as driver 580 can.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import api
from test_e2e_kernels import _lease_of, _state_is, _until
from test_restore_fit import SIM, _checkpoint

pytestmark = pytest.mark.slow

GiB = 1024**3


@pytest.fixture
def sched_config(sched_config):
    sched_config.update(
        simulated_devices=[{"name": "A100", "memory": "80GiB"}, {"name": "H100", "memory": "80GiB"}],
        policy="dynamic",
        checkpoint_host_memory="unlimited",
    )
    return sched_config


async def test_a_lease_on_one_model_is_never_resumed_on_another(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    clock = use_clock
    gpu_kernelspec("gpu")
    a = await start_kernel("gpu")
    out = await a.execute(SIM + "simulated.allocate('2GiB')\nmarker = 'state kept'")
    assert out["error"] is None, out
    await arbiter.tick()
    home = (await _lease_of(jp_fetch, a.id))["devices"]
    names = {d.uuid: d.name for d in arbiter.state.snapshot}
    lease_a = await _checkpoint(arbiter, jp_fetch, a.id)

    # Two other kernels take both GPUs; the one on the other model gives its lease back.
    c = await start_kernel("gpu")
    d = await start_kernel("gpu")
    held = {}
    for k in (c, d):
        code, lease = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k.id})
        assert code == 201, lease
        held[k.id] = lease
    on_home = next(k for k in (c, d) if held[k.id]["devices"] == home)
    other = next(k for k in (c, d) if k is not on_home)
    busy = asyncio.ensure_future(on_home.execute("import time; time.sleep(6)", timeout=60))
    code, _ = await api(jp_fetch, "leases", held[other.id]["id"], method="DELETE")
    assert code == 204

    # A's next cell waits for a GPU of its model although the other model's GPU is free.
    resumed = asyncio.ensure_future(a.execute("print(marker, simulated.memory_allocated())", timeout=120))
    await _until(lambda: _state_is(jp_fetch, lease_a, "pending"), what="A to ask for its GPU back")
    for _ in range(3):
        clock.advance(5)
        await arbiter.tick()
        await asyncio.sleep(0.3)
    lease = await _lease_of(jp_fetch, a.id)
    assert lease["state"] == "pending", lease
    model = names[home[0]]
    assert lease["reason"].startswith(f"waiting for a {model} GPU to restore onto"), lease
    assert not resumed.done()
    await busy

    # The GPU of its model is given back: A runs there, its memory intact.
    code, _ = await api(jp_fetch, "leases", held[on_home.id]["id"], method="DELETE")
    assert code == 204
    out = await resumed
    assert out["error"] is None, out
    assert f"state kept {2 * GiB}" in out["stdout"], out
    lease = await _lease_of(jp_fetch, a.id)
    assert lease["devices"] == home and names[lease["devices"][0]] == model
