"""On a real NVIDIA GPU (``pytest -m gpu``): NVML attribution, checkpoint and restore of PyTorch.

Needs NVML, PyTorch with CUDA in the kernel's Python, and CUDA checkpoint support (driver 570+,
``cuda.bindings`` or ``cuda-checkpoint``). Skipped elsewhere.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import api

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _nvml_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:  # noqa: BLE001 - no driver: skip
        return 0


@pytest.fixture
def sched_config():
    return {"backend": "nvml", "poll_interval": 0.5}


@pytest.fixture(autouse=True)
def _needs_gpu_and_torch():
    if _nvml_gpus() < 1:
        pytest.skip("no NVIDIA GPU visible through NVML")
    try:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("PyTorch has no CUDA here")
    except ImportError:
        pytest.skip("PyTorch is not installed")


async def test_pytorch_memory_is_attributed_checkpointed_and_restored(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter, use_clock
):
    if not arbiter.caps.checkpoint:
        pytest.skip(f"no CUDA checkpoint support: {arbiter.caps.checkpoint_reason}")
    clock = use_clock
    gpu_kernelspec("gpu")
    k1 = await start_kernel("gpu")
    out = await k1.execute(
        "import torch\n"
        "x = torch.arange(64 * 1024 * 1024, device='cuda', dtype=torch.float32)\n"
        "torch.cuda.synchronize()\n"
        "print('SUM', x.sum().item())",
        timeout=180,
    )
    assert out["error"] is None, out
    expected = out["stdout"].split("SUM", 1)[1].strip()
    lease = (await api(jp_fetch, "leases", params={"kernel_id": k1.id}))[1][0]
    uuid = lease["devices"][0]

    # NVML sees the kernel's process on its GPU and the server maps it to the kernel.
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    device = next(d for d in status["devices"] if d["uuid"] == uuid)
    mine = [p for p in device["processes"] if p["kernel_id"] == k1.id]
    assert mine and mine[0]["memory_used"] >= 256 * 1024**2

    # Another kernel waits for that GPU; the idle PyTorch kernel is checkpointed and the GPU
    # is completely free of it.
    others = [d for d in status["devices"] if d["uuid"] != uuid and d["health"] == "ok"]
    for other in others:
        await api(jp_fetch, "devices", other["uuid"], "drain", method="POST")
    k2 = await start_kernel("gpu")
    code, pending = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2.id})
    assert code == 202
    clock.advance(600)
    await arbiter.tick()
    for _ in range(120):
        got = (await api(jp_fetch, "leases", lease["id"]))[1]
        if got["state"] == "suspended":
            break
        await asyncio.sleep(0.5)
    assert got["state"] == "suspended", got
    await arbiter.tick()
    _, status = await api(jp_fetch, "status")
    device = next(d for d in status["devices"] if d["uuid"] == uuid)
    assert not [p for p in device["processes"] if p["kernel_id"] == k1.id]
    assert (await api(jp_fetch, "leases", pending["id"]))[1]["state"] == "active"

    # The second kernel lets go; the first kernel's next cell is restored with its tensors intact.
    await api(jp_fetch, "leases", pending["id"], method="DELETE")
    out = await k1.execute("torch.cuda.synchronize(); print('SUM', x.sum().item())", timeout=180)
    assert out["error"] is None, out
    assert out["stdout"].split("SUM", 1)[1].strip() == expected
    for other in others:
        await api(jp_fetch, "devices", other["uuid"], "undrain", method="POST")
