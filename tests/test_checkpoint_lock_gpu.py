"""On a real NVIDIA GPU (``pytest -m gpu``): a checkpoint whose lock times out on PyTorch work.

A kernel keeps the GPU busy with a long loop of matrix products launched from a thread (the
kernel itself is idle, as after a cell that queued work and returned). With a lock timeout far
shorter than that work, the driver's ``cuCheckpointProcessLock`` gives up: the lease stays active
with a reason that says the GPU work did not pause, and the kernel's tensors are intact.

Needs NVML, PyTorch with CUDA in the kernel's Python, and CUDA checkpoint support (driver 570+,
``cuda.bindings`` or ``cuda-checkpoint``). Skipped elsewhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import api
from jupyter_gpusched.core import LeaseState, Step
from test_e2e_kernels import _lease_of, _state_is, _until
from test_gpu_e2e import _nvml_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LOCK_MS = 200


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


async def test_a_lock_that_times_out_on_a_long_matmul_loop_leaves_the_lease_active(
    jp_fetch, gpu_kernelspec, start_kernel, arbiter
):
    if not arbiter.caps.checkpoint:
        pytest.skip(f"no CUDA checkpoint support: {arbiter.caps.checkpoint_reason}")
    arbiter.checkpointer.lock_timeout_ms = LOCK_MS
    gpu_kernelspec("gpu")
    k = await start_kernel("gpu")
    out = await k.execute(
        "import threading, time, torch\n"
        "torch.backends.cuda.matmul.allow_tf32 = False\n"
        "x = torch.randn(8192, 8192, device='cuda')\n"
        "expected = x.sum().item()\n"
        "def one():\n"
        "    torch.cuda.synchronize(); t = time.perf_counter(); x @ x; torch.cuda.synchronize()\n"
        "    return time.perf_counter() - t\n"
        "one(); per = one()\n"
        "def work():\n"
        "    # about 20 s of GPU work, launched back to back\n"
        "    for _ in range(max(1, int(20 / per))):\n"
        "        y = x @ x\n"
        "    torch.cuda.synchronize()\n"
        "worker = threading.Thread(target=work, daemon=True); worker.start()\n"
        "time.sleep(1.0)\n"
        "print('PER', per)",
        timeout=180,
    )
    assert out["error"] is None, out
    lease = await _lease_of(jp_fetch, k.id)
    await arbiter.tick()

    def due(cur, now):
        return replace(cur, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT, reclaim_at=now, reason="idle")

    arbiter.reclaims.carry_out_due([await arbiter.update(arbiter.live_lease(lease["id"]), due)])
    await _until(lambda: _state_is(jp_fetch, lease["id"], "active"), timeout=60, what="the lock to time out")
    got = (await api(jp_fetch, "leases", lease["id"]))[1]
    assert f"the kernel's GPU work did not pause within {LOCK_MS} ms" in got["reason"], got
    assert got["devices"] == lease["devices"]
    assert arbiter.ledger.checkpoints() == []

    # The kernel is unharmed: its work finishes and its tensor is intact.
    out = await k.execute("worker.join(); torch.cuda.synchronize(); print('OK', x.sum().item() == expected)", timeout=180)
    assert out["error"] is None and "OK True" in out["stdout"], out
