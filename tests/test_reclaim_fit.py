"""What the reclaim executor decides from what it read (reclaim/fit.py): which processes a reclaim
touches, whether a checkpoint fits the host's budget and each process's memory cgroup, and whether a
restore fits on its GPUs. Pure functions, table-tested; no GPU, ledger or server."""

from __future__ import annotations

from dataclasses import replace

import pytest

from jupyter_gpusched.core import LeaseState, Step, new_claim
from jupyter_gpusched.core.placement import RESTORE_MARGIN
from jupyter_gpusched.devices.base import DeviceSnapshot, GPUProcess
from jupyter_gpusched.ledger import Checkpoint
from jupyter_gpusched.reclaim import fit

GiB = 1024**3


def _lease(lease_id="a", devices=("GPU-0",), held=None, state=LeaseState.ACTIVE, **changes):
    lease = new_claim(lease_id, f"k-{lease_id}", "alice", 0.0)
    return replace(lease, state=state, devices=tuple(devices), memory_held=held, **changes)


def _gpu(uuid, index, *procs, total=80 * GiB, used=...):
    processes = tuple(GPUProcess(pid, memory) for pid, memory in procs)
    if used is ...:
        used = sum(m or 0 for _, m in procs)
    return DeviceSnapshot(uuid=uuid, index=index, name="H100", memory_total=total, memory_used=used, processes=processes)


SNAPSHOT = (
    _gpu("GPU-0", 0, (10, 2 * GiB), (11, GiB), (99, 4 * GiB)),
    _gpu("GPU-1", 1, (10, GiB), (12, None)),
)


@pytest.mark.parametrize(
    ("devices", "tree", "expected"),
    [
        (("GPU-0",), {10, 11, 12}, [10, 11]),  # 99 is not the kernel's; 12 is on another GPU
        (("GPU-0", "GPU-1"), {10, 11, 12}, [10, 11, 12]),  # a pid on two GPUs counts once
        (("GPU-1",), {11}, []),
        (("GPU-0",), set(), []),
        ((), {10}, []),
    ],
)
def test_a_reclaim_touches_only_the_kernels_processes_on_the_leases_gpus(devices, tree, expected):
    assert fit.gpu_pids(_lease(devices=devices), SNAPSHOT, tree) == expected


def test_what_each_process_holds_on_the_leases_gpus_only():
    lease = _lease(devices=("GPU-0", "GPU-1"))
    assert fit.held_on_lease(lease, [10, 12], SNAPSHOT) == {10: 3 * GiB, 12: 0}
    assert fit.held_on_lease(_lease(devices=("GPU-1",)), [10, 11], SNAPSHOT) == {10: GiB}


def test_the_host_budget_counts_the_other_leases_checkpoints_and_not_the_leases_own():
    lease = _lease(held=GiB, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT)
    suspended = _lease("b", devices=(), held=2 * GiB, state=LeaseState.SUSPENDED)
    waiting = _lease("c", devices=(), held=GiB, state=LeaseState.PENDING, home=("GPU-1",))
    active = _lease("d", held=10 * GiB)
    leases = [lease, suspended, waiting, active]
    assert fit.over_host_budget(lease, {10: 3 * GiB}, None, leases) is None, "no limit"
    assert fit.over_host_budget(lease, {10: 3 * GiB}, 6 * GiB, leases) is None
    assert fit.over_host_budget(lease, {10: 3 * GiB}, 5 * GiB, leases) == (
        "a checkpoint of 3.0 GiB would not fit in the host memory left for checkpoints "
        "(2.0 GiB left of what the checkpoint_host_memory setting allows)"
    )


def test_the_host_budget_takes_what_the_lease_held_where_no_size_is_reported():
    lease = _lease(held=4 * GiB)
    assert fit.over_host_budget(lease, {10: 0}, 3 * GiB, [lease]).startswith("a checkpoint of 4.0 GiB would not fit")
    assert fit.over_host_budget(lease, {}, 4 * GiB, [lease]) is None


def test_a_process_whose_cgroup_cannot_hold_its_checkpoint_is_named():
    sizes = {12: 4 * GiB, 10: 3 * GiB, 11: GiB}
    assert fit.over_cgroup(sizes, {}) is None, "no limit known"
    assert fit.over_cgroup(sizes, {10: 3 * GiB, 11: None, 12: 5 * GiB}) is None
    assert fit.over_cgroup(sizes, {10: 2 * GiB, 12: GiB}) == (
        "process 10's 3.0 GiB of GPU memory would not fit in the 2.0 GiB its memory limit (cgroup) leaves it"
    )


def _record(pid, memory, devices=("GPU-0",), lease_id="a"):
    return Checkpoint(pid, 1.0, lease_id, f"k-{lease_id}", tuple(devices), memory, 2.0)


def test_a_restore_needs_what_its_checkpoints_moved_spread_over_its_gpus_with_a_margin():
    lease = _lease(devices=("GPU-0", "GPU-1"), held=9 * GiB)
    assert fit.restore_needs(lease, []) == {}
    assert fit.restore_needs(lease, [_record(10, 3 * GiB), _record(11, GiB)]) == {
        "GPU-0": 2 * GiB + RESTORE_MARGIN, "GPU-1": 2 * GiB + RESTORE_MARGIN,
    }
    # One size unknown: what the kernel held when it was checkpointed.
    assert fit.restore_needs(lease, [_record(10, 3 * GiB), _record(11, None)])["GPU-0"] == 4 * GiB + GiB // 2 + RESTORE_MARGIN
    assert fit.restore_needs(replace(lease, memory_held=None), [_record(10, None)]) == {}


def test_an_orphan_needs_its_own_gpus():
    lease = _lease(devices=(), held=6 * GiB)
    assert fit.orphan_needs(_record(10, 2 * GiB, ("GPU-1",)), lease) == {"GPU-1": 2 * GiB + RESTORE_MARGIN}
    assert fit.orphan_needs(_record(10, None, ("GPU-0", "GPU-1")), lease) == {
        "GPU-0": 3 * GiB + RESTORE_MARGIN, "GPU-1": 3 * GiB + RESTORE_MARGIN,
    }
    assert fit.orphan_needs(_record(10, None), replace(lease, memory_held=None)) == {}


def test_a_restore_waits_for_room_on_the_first_gpu_too_full_and_says_how_much_is_free():
    snapshot = (_gpu("GPU-0", 0, total=80 * GiB, used=30 * GiB), _gpu("GPU-1", 1, total=80 * GiB, used=None))
    assert fit.room_short(snapshot, {"GPU-0": 50 * GiB}) is None
    assert fit.room_short(snapshot, {"GPU-1": 500 * GiB}) is None, "memory in use not reported"
    assert fit.room_short(snapshot, {"GPU-9": 500 * GiB}) is None, "not a GPU of this host"
    assert fit.room_short(snapshot, {"GPU-0": 60 * GiB + RESTORE_MARGIN}) == (
        "waiting for room to restore: GPU 0 has 50.0 GiB free, too little for its 60.0 GiB checkpoint "
        f"(and a {fit.core.format_bytes(RESTORE_MARGIN)} margin); it is restored once enough memory is free"
    )
