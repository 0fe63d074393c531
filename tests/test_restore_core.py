"""The core's rules for resuming a suspended lease: only where its checkpoint fits, and onto other
GPUs only as the driver's remap allows (same model, every GPU of the lease mapped)."""

from __future__ import annotations

from dataclasses import replace

from jupyter_gpusched.core import Capabilities, Device, GiB, LeaseState, request_resume, suspended
from jupyter_gpusched.core.placement import RESTORE_MARGIN

from test_core_scheduler import CHECKPOINT, Host

REMAP = Capabilities(checkpoint=True, remap=True)


def suspended_holding(devices, home, caps, memory_held, count=None):
    """A lease of sue's suspended off ``home`` with a checkpoint of ``memory_held`` bytes, asking back."""
    host = Host(devices, caps=caps)
    home = (home,) if isinstance(home, str) else tuple(home)
    host.claim("s", "sue", count=count or len(home))
    host.tick(0)
    host.leases["s"] = replace(host["s"], devices=home, memory_held=memory_held)
    host.leases["s"] = request_resume(suspended(host["s"], 10), 20)
    return host


def with_used(host, uuid, used):
    host.devices = [replace(d, memory_used=used) if d.uuid == uuid else d for d in host.devices]


def test_a_restore_waits_while_memory_outside_any_lease_leaves_too_little_room():
    host = suspended_holding([Device("GPU-0", 0, "H100", 80 * GiB)], "GPU-0", CHECKPOINT, 60 * GiB)
    with_used(host, "GPU-0", 30 * GiB)  # a process that holds no lease keeps 30 GiB
    host.tick(30)
    assert host["s"].state == LeaseState.PENDING
    reason = host["s"].reason
    assert reason.startswith("waiting for room to restore: GPU 0 has 50.0 GiB free, too little for its 60.0 GiB")
    assert "processes outside any lease use 30.0 GiB" in reason

    with_used(host, "GPU-0", 0)  # that process ended
    host.tick(31)
    assert host["s"].state == LeaseState.ACTIVE and host["s"].devices == ("GPU-0",)
    assert host["s"].reason.startswith("restored onto")


def test_the_margin_counts_too():
    host = suspended_holding([Device("GPU-0", 0, "H100", 80 * GiB)], "GPU-0", CHECKPOINT, 60 * GiB)
    with_used(host, "GPU-0", 20 * GiB - RESTORE_MARGIN + 1)
    host.tick(30)
    assert host["s"].state == LeaseState.PENDING
    with_used(host, "GPU-0", 20 * GiB - RESTORE_MARGIN)
    host.tick(31)
    assert host["s"].state == LeaseState.ACTIVE


def test_memory_of_the_holders_own_kernels_is_not_counted_twice_and_frees_with_their_lease():
    devices = [Device("GPU-0", 0, "H100", 80 * GiB)]
    host = suspended_holding(devices, "GPU-0", CHECKPOINT, 60 * GiB)
    host.claim("b", "bob")
    host.leases["b"] = replace(
        host["b"], state=LeaseState.ACTIVE, devices=("GPU-0",), memory_held=30 * GiB, last_active_at=20
    )
    host.kernel("b", busy=True, memory=30 * GiB)
    with_used(host, "GPU-0", 30 * GiB)
    host.tick(30)
    # Bob's lease holds the GPU: the restore waits for the GPU, not for room outside the leases.
    assert host["s"].reason == "waiting for the GPU it was checkpointed from to be free"
    host.release("b")
    host.tick(31)
    assert "30.0 GiB" in host["s"].reason and host["s"].state == LeaseState.PENDING


def test_a_restore_with_remap_takes_a_gpu_of_its_model_that_has_room():
    # GPU 1 is the busier one, but GPU 0, its own, lacks room for the checkpoint.
    devices = [Device("GPU-0", 0, "H100", 80 * GiB), Device("GPU-1", 1, "H100", 80 * GiB, utilization=50.0)]
    host = suspended_holding(devices, "GPU-0", REMAP, 60 * GiB)
    with_used(host, "GPU-0", 30 * GiB)
    host.tick(30)
    assert host["s"].state == LeaseState.ACTIVE and host["s"].devices == ("GPU-1",)


def test_a_restore_with_remap_prefers_its_own_gpu():
    devices = [Device("GPU-0", 0, "H100", 80 * GiB), Device("GPU-1", 1, "H100", 80 * GiB)]
    host = suspended_holding(devices, "GPU-1", REMAP, 10 * GiB)
    host.tick(30)
    assert host["s"].devices == ("GPU-1",)


def test_a_lease_is_never_resumed_on_another_model_even_with_room_there():
    devices = [Device("GPU-0", 0, "A100", 80 * GiB), Device("GPU-1", 1, "H100", 80 * GiB)]
    host = suspended_holding(devices, "GPU-0", REMAP, 60 * GiB)
    with_used(host, "GPU-0", 30 * GiB)
    host.tick(30)
    assert host["s"].state == LeaseState.PENDING
    assert "waiting for room to restore" in host["s"].reason


def test_a_lease_of_two_models_is_restored_only_onto_its_own_gpus():
    devices = [
        Device("GPU-0", 0, "A100"), Device("GPU-1", 1, "H100"), Device("GPU-2", 2, "A100"), Device("GPU-3", 3, "H100"),
    ]
    host = suspended_holding(devices, ("GPU-0", "GPU-1"), REMAP, 2 * GiB)
    host.claim("x", "xena")
    host.leases["x"] = replace(host["x"], state=LeaseState.ACTIVE, devices=("GPU-0",), last_active_at=20)
    host.kernel("x", busy=True)
    host.tick(30)
    # GPUs 2 and 3 would match by model one for one, but the pairing of models is not checked by
    # the driver's map as this host can build it: the restore waits for its own GPUs.
    assert host["s"].state == LeaseState.PENDING
    assert host["s"].reason == "waiting for the GPU it was checkpointed from to be free"


def test_a_restore_whose_gpu_is_gone_from_the_inventory_is_not_moved_to_any_model():
    devices = [Device("GPU-1", 1, "H100")]
    host = suspended_holding(devices, "GPU-1", REMAP, 2 * GiB)
    host.leases["s"] = replace(host["s"], home=("GPU-9",))
    host.tick(30)
    assert host["s"].state == LeaseState.PENDING
    assert "drained or lost" in host["s"].reason



def test_a_shared_restore_counts_what_the_other_kernels_on_the_gpu_really_hold():
    # Bob's shared lease was promised 10 GiB but his kernel holds 40 GiB: the 45 GiB checkpoint
    # fits by the books (10 + 45) but not in the memory really free (80 - 40).
    devices = [Device("GPU-0", 0, "H100", 80 * GiB)]
    host = Host(devices, caps=CHECKPOINT)
    host.claim("s", "sue", mode="shared", memory=10 * GiB)
    host.tick(0)
    host.leases["s"] = replace(host["s"], devices=("GPU-0",), memory_held=45 * GiB)
    host.leases["s"] = request_resume(suspended(host["s"], 10), 20)
    host.claim("b", "bob", mode="shared", memory=10 * GiB)
    host.leases["b"] = replace(
        host["b"], state=LeaseState.ACTIVE, devices=("GPU-0",), memory_held=40 * GiB, last_active_at=20
    )
    host.kernel("b", busy=True, memory=40 * GiB)
    with_used(host, "GPU-0", 40 * GiB)
    host.tick(30)
    assert host["s"].state == LeaseState.PENDING

    host.kernel("b", busy=True, memory=30 * GiB)  # bob frees 10 GiB: 50 GiB free now
    host.leases["b"] = replace(host["b"], memory_held=30 * GiB)
    with_used(host, "GPU-0", 30 * GiB)
    host.tick(31)
    assert host["s"].state == LeaseState.ACTIVE and host["s"].devices == ("GPU-0",)
