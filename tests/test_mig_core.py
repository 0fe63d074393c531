"""MIG instances cannot be checkpointed (NVIDIA/cuda-checkpoint#42): the core skips that step there.

The ladder goes to the next step on a MIG instance, or on any GPU the checkpointer said it cannot
serve, and the idle forecast says so ahead, in the user's words; a lease on a whole GPU of the
same host is still checkpointed.
"""

from __future__ import annotations

from jupyter_gpusched.core import Capabilities, Device, GiB, Lease, LeaseState, SchedConfig, Step, plan
from jupyter_gpusched.core.forecast import forecast
from jupyter_gpusched.core.ladder import MIG_REFUSED, choose_step, serving

T0 = 1_000_000.0
# One whole GPU and two MIG instances of another.
DEVICES = (
    Device("GPU-0", 0, name="A100"),
    Device("GPU-1", 1, name="A100"),
    Device("MIG-a", 2, name="A100 MIG 3g.40gb", memory_total=40 * GiB, parent="GPU-1"),
    Device("MIG-b", 3, name="A100 MIG 3g.40gb", memory_total=40 * GiB, parent="GPU-1"),
)
CHECKPOINT = Capabilities(checkpoint=True, checkpoint_reason="driver 570")


def held(lease_id: str, device: str, idle_for: float = 0.0, **fields) -> Lease:
    base = dict(
        id=lease_id,
        kernel_id=f"k{lease_id}",
        user="alice",
        state=LeaseState.ACTIVE,
        devices=(device,),
        created_at=T0 - idle_for - 10,
        queued_at=T0 - idle_for - 10,
        granted_at=T0 - idle_for - 10,
        last_active_at=T0 - idle_for,
        memory_held=2 * GiB,
    )
    base.update(fields)
    return Lease(**base)


def test_the_ladder_skips_the_checkpoint_step_on_a_mig_instance_and_says_why():
    caps = serving(CHECKPOINT, DEVICES)
    step, why = choose_step(held("m", "MIG-a", state=LeaseState.IDLE), SchedConfig(), caps)
    assert step == Step.RESTART
    assert why.startswith(f"its GPU state cannot be kept (a restart is all that is left): {MIG_REFUSED}: GPU 2 (A100 MIG 3g.40gb) is a MIG instance")

    # A whole GPU of the same host is checkpointed as before.
    assert choose_step(held("w", "GPU-0", state=LeaseState.IDLE), SchedConfig(), caps)[0] == Step.CHECKPOINT

    # Never disrupt: nothing is done, and the reason says why.
    step, why = choose_step(held("m", "MIG-a", state=LeaseState.IDLE), SchedConfig(reclaim_fallback="none"), caps)
    assert step is None and why.startswith(MIG_REFUSED) and why.endswith("never restarts or shuts down a kernel to free a GPU (reclaim_fallback is 'none')")

    # A shared lease over its share goes to free-cache, saying the checkpoint cannot be taken.
    over = held("m", "MIG-a", state=LeaseState.IDLE, mode="shared", memory=GiB)
    step, why = choose_step(over, SchedConfig(), caps)
    assert step == Step.FREE_CACHE and why.startswith(MIG_REFUSED)


def test_a_gpu_the_checkpointer_cannot_serve_is_skipped_like_a_mig_instance():
    why_not = "the CUDA driver does not support checkpoints on GPU 0"
    caps = Capabilities(checkpoint=True, checkpoint_reason="driver 570", no_checkpoint={"GPU-0": why_not})
    step, why = choose_step(held("w", "GPU-0", state=LeaseState.IDLE), SchedConfig(), caps)
    assert step == Step.RESTART and why == f"its GPU state cannot be kept (a restart is all that is left): {why_not}"
    assert choose_step(held("x", "GPU-1", state=LeaseState.IDLE), SchedConfig(), caps)[0] == Step.CHECKPOINT


def test_serving_adds_only_mig_instances_and_only_where_checkpoints_are_possible():
    caps = serving(CHECKPOINT, DEVICES)
    assert set(caps.no_checkpoint) == {"MIG-a", "MIG-b"}
    assert serving(CHECKPOINT, DEVICES[:2]) is CHECKPOINT
    without = Capabilities(checkpoint=False, checkpoint_reason="driver 550")
    assert serving(without, DEVICES) is without


def test_a_pass_reclaims_an_idle_mig_lease_with_the_next_step_not_a_checkpoint():
    cfg = SchedConfig(policy="dynamic", idle_timeout=60, contended_idle_timeout=60, grace_period=30)
    caps = serving(CHECKPOINT, DEVICES)
    leases = [
        held("m", "MIG-a", idle_for=600, state=LeaseState.IDLE),
        held("n", "MIG-b", idle_for=0, busy=True),
        held("w", "GPU-0", idle_for=0, busy=True),
        held("x", "GPU-1", idle_for=0, busy=True, user="bob"),
        Lease(id="p", kernel_id="kp", user="carol", state=LeaseState.PENDING, memory=10 * GiB, mode="shared",
              created_at=T0, queued_at=T0, last_active_at=T0),
    ]
    result = plan(DEVICES, leases, {}, T0, cfg, caps)
    mig = result.lease("m")
    assert mig.state == LeaseState.RECLAIMING and mig.reclaim_step == Step.RESTART
    assert MIG_REFUSED in mig.reason and mig.reclaim_at == T0 + 30, "announced a grace period ahead"


def test_the_forecast_of_a_mig_lease_says_ahead_that_it_will_not_be_checkpointed():
    cfg = SchedConfig(idle_timeout=300, release_timeout=3600, contended_idle_timeout=60, grace_period=60)
    mig = held("m", "MIG-a", idle_for=10)
    whole = held("w", "GPU-0", idle_for=10)
    fc = forecast(mig, [mig, whole], T0, cfg, CHECKPOINT, DEVICES)
    assert fc.step == Step.RESTART
    assert fc.reason.startswith(f"{MIG_REFUSED}: GPU 2 (A100 MIG 3g.40gb) is a MIG instance")
    assert "restarted (its variables are lost)" in fc.reason
    assert fc.at == T0 - 10 + 3600 + 60, "after release_timeout and the grace period"

    # The whole GPU's lease is forecast to be checkpointed, as before.
    assert forecast(whole, [mig, whole], T0, cfg, CHECKPOINT, DEVICES).step == Step.CHECKPOINT

    # With reclaim_fallback 'none' the MIG lease is never taken back, and the forecast says why.
    fc = forecast(mig, [mig], T0, SchedConfig(reclaim_fallback="none"), CHECKPOINT, DEVICES)
    assert fc.step is None and fc.at is None and MIG_REFUSED in fc.reason
