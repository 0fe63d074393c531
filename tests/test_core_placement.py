"""Which GPUs a claim gets: least loaded, best fit, NVLink groups, MIG, health."""

from __future__ import annotations

from dataclasses import replace

import pytest

from jupyter_gpusched.core import EXCLUSIVE, SHARED, GiB, Device, Health, LeaseState, new_claim
from jupyter_gpusched.core.placement import capacity_for, occupancy, place, schedulable


def gpus(n, **kw):
    return [Device(f"GPU-{i}", i, **kw) for i in range(n)]


def claim(lease_id="c", *, count=1, memory=None, mode=EXCLUSIVE, user="alice"):
    return new_claim(lease_id, f"k-{lease_id}", user, 0.0, count=count, memory=memory, mode=mode)


def holding(lease_id, devices, *, memory=None, mode=EXCLUSIVE):
    lease = claim(lease_id, count=len(devices), memory=memory, mode=mode)
    return replace(lease, state=LeaseState.ACTIVE, devices=tuple(devices), granted_at=0.0)


def chosen(result):
    assert result is not None, "the claim should have been placed"
    return result[0]


# -- exclusive: least loaded ------------------------------------------------------------------


def test_exclusive_claim_takes_the_least_utilized_free_gpu():
    devices = [
        Device("GPU-0", 0, utilization=70.0),
        Device("GPU-1", 1, utilization=5.0),
        Device("GPU-2", 2, utilization=30.0),
    ]
    uuids, reason = place(claim(), devices, [])
    assert uuids == ("GPU-1",)
    assert reason == "least loaded free GPU: GPU 1"


def test_exclusive_ties_go_to_less_memory_used_then_lowest_index():
    devices = [
        Device("GPU-0", 0, utilization=0.0, memory_used=4 * GiB),
        Device("GPU-1", 1, utilization=0.0, memory_used=1 * GiB),
        Device("GPU-2", 2, utilization=0.0, memory_used=1 * GiB),
    ]
    assert chosen(place(claim(), devices, [])) == ("GPU-1",)
    assert chosen(place(claim(), gpus(3), [])) == ("GPU-0",)


def test_exclusive_claim_never_joins_a_gpu_someone_holds():
    devices = gpus(3)
    leases = [holding("a", ["GPU-0"]), holding("b", ["GPU-1"], memory=1 * GiB, mode=SHARED)]
    assert chosen(place(claim(), devices, leases)) == ("GPU-2",)
    assert place(claim(count=2), devices, leases) is None


def test_released_and_pending_leases_hold_nothing():
    devices = gpus(1)
    gone = replace(holding("a", ["GPU-0"]), state=LeaseState.RELEASED)
    waiting = claim("w")
    assert chosen(place(claim(), devices, [gone, waiting])) == ("GPU-0",)


def test_exclusive_claim_with_a_memory_size_skips_gpus_that_are_too_small():
    devices = [Device("MIG-0", 0, "A100 1g.10gb", 10 * GiB, parent="GPU-A"), Device("GPU-B", 1, "A100", 80 * GiB)]
    assert chosen(place(claim(memory=40 * GiB), devices, [])) == ("GPU-B",)
    assert capacity_for(claim(memory=40 * GiB), devices) == 1


# -- shared: best fit by memory ---------------------------------------------------------------


@pytest.fixture
def partly_promised():
    """Three 80 GiB GPUs with 20, 40 and 80 GiB not promised to anyone."""
    devices = gpus(3)
    leases = [
        holding("a", ["GPU-0"], memory=60 * GiB, mode=SHARED),
        holding("b", ["GPU-1"], memory=40 * GiB, mode=SHARED),
    ]
    return devices, leases


@pytest.mark.parametrize(
    ("memory", "where"),
    [(16 * GiB, "GPU-0"), (20 * GiB, "GPU-0"), (30 * GiB, "GPU-1"), (40 * GiB, "GPU-1"), (50 * GiB, "GPU-2")],
)
def test_shared_claim_goes_where_it_fits_most_tightly(partly_promised, memory, where):
    devices, leases = partly_promised
    uuids, reason = place(claim(memory=memory, mode=SHARED), devices, leases)
    assert uuids == (where,)
    assert reason.startswith("best fit by memory")


def test_shared_claims_never_promise_more_memory_than_a_gpu_has():
    devices = gpus(1)
    leases = [holding("a", ["GPU-0"], memory=50 * GiB, mode=SHARED)]
    assert place(claim(memory=30 * GiB, mode=SHARED), devices, leases) is not None
    assert place(claim(memory=31 * GiB, mode=SHARED), devices, leases) is None


def test_shared_claim_without_memory_wants_a_whole_gpu():
    devices = gpus(2)
    leases = [holding("a", ["GPU-0"], memory=1 * GiB, mode=SHARED)]
    assert chosen(place(claim(mode=SHARED), devices, leases)) == ("GPU-1",)
    whole = [holding("w", ["GPU-0"], mode=SHARED)]
    assert place(claim(memory=1 * GiB, mode=SHARED), gpus(1), whole) is None


def test_shared_claim_never_joins_an_exclusive_lease():
    assert place(claim(memory=1 * GiB, mode=SHARED), gpus(1), [holding("a", ["GPU-0"])]) is None


def test_occupancy_sums_what_was_promised():
    devices = gpus(2)
    leases = [
        holding("a", ["GPU-0"], memory=10 * GiB, mode=SHARED),
        holding("b", ["GPU-0"], memory=20 * GiB, mode=SHARED),
        holding("c", ["GPU-1"]),
    ]
    occ = occupancy(devices, leases)
    assert (occ["GPU-0"].exclusive, occ["GPU-0"].promised, occ["GPU-0"].holders) == (False, 30 * GiB, 2)
    assert (occ["GPU-1"].exclusive, occ["GPU-1"].promised, occ["GPU-1"].holders) == (True, 80 * GiB, 1)


# -- multi-GPU claims and NVLink groups -------------------------------------------------------


def nvlink_box():
    """Two NVLink pairs: GPUs 0-1 and 2-3; the second pair is the less loaded."""
    return [
        Device("GPU-0", 0, group="nv-a", utilization=0.0),
        Device("GPU-1", 1, group="nv-a", utilization=50.0),
        Device("GPU-2", 2, group="nv-b", utilization=10.0),
        Device("GPU-3", 3, group="nv-b", utilization=20.0),
    ]


def test_two_gpu_claim_lands_within_one_nvlink_group():
    uuids, reason = place(claim(count=2), nvlink_box(), [])
    assert set(uuids) in ({"GPU-0", "GPU-1"}, {"GPU-2", "GPU-3"})
    assert "one NVLink group" in reason


def test_multi_gpu_claim_uses_the_group_that_still_has_room():
    # GPU 2 is taken: only the pair 0-1 can hold a 2-GPU claim in one group, although GPU 3
    # is less loaded than GPU 1.
    leases = [holding("a", ["GPU-2"])]
    uuids, reason = place(claim(count=2), nvlink_box(), leases)
    assert set(uuids) == {"GPU-0", "GPU-1"}
    assert "(nv-a)" in reason


def test_multi_gpu_claim_keeps_bigger_groups_whole():
    devices = [Device(f"GPU-{i}", i, group="big") for i in range(4)] + [
        Device(f"GPU-{i}", i, group="small") for i in range(4, 6)
    ]
    assert set(chosen(place(claim(count=2), devices, []))) == {"GPU-4", "GPU-5"}
    assert set(chosen(place(claim(count=3), devices, []))) == {"GPU-0", "GPU-1", "GPU-2"}


def test_multi_gpu_claim_spans_groups_only_when_no_group_has_room():
    leases = [holding("a", ["GPU-0"]), holding("b", ["GPU-2"])]
    uuids, reason = place(claim(count=2), nvlink_box(), leases)
    assert set(uuids) == {"GPU-1", "GPU-3"}
    assert "no single NVLink group has enough free" in reason


def test_multi_gpu_claim_needs_that_many_distinct_free_gpus():
    assert place(claim(count=3), gpus(2), []) is None
    uuids = chosen(place(claim(count=3), gpus(4), []))
    assert len(set(uuids)) == 3


# -- MIG and device health --------------------------------------------------------------------


def mig_host():
    return [
        Device("GPU-A", 0, "A100", 80 * GiB),
        Device("MIG-A1", 1, "A100 3g.40gb", 40 * GiB, parent="GPU-A"),
        Device("MIG-A2", 2, "A100 3g.40gb", 40 * GiB, parent="GPU-A"),
    ]


def test_a_gpu_split_into_mig_instances_is_never_handed_out_whole():
    devices = mig_host()
    assert [d.uuid for d in schedulable(devices)] == ["MIG-A1", "MIG-A2"]
    leases = [holding("a", ["MIG-A1"]), holding("b", ["MIG-A2"])]
    assert place(claim(), devices, leases) is None
    assert place(claim(memory=1 * GiB, mode=SHARED), devices, leases) is None


def test_mig_instances_are_devices_with_their_own_memory():
    devices = mig_host()
    assert chosen(place(claim(memory=20 * GiB, mode=SHARED), devices, [])) in (("MIG-A1",), ("MIG-A2",))
    assert place(claim(memory=60 * GiB, mode=SHARED), devices, []) is None
    assert place(claim(memory=60 * GiB), devices, []) is None
    assert capacity_for(claim(count=2), devices) == 2


@pytest.mark.parametrize("health", [Health.DRAINED, Health.LOST])
def test_drained_and_lost_gpus_are_never_chosen(health):
    devices = [Device("GPU-0", 0, health=health, utilization=0.0), Device("GPU-1", 1, utilization=99.0)]
    assert chosen(place(claim(), devices, [])) == ("GPU-1",)
    assert chosen(place(claim(memory=GiB, mode=SHARED), devices, [])) == ("GPU-1",)
    assert place(claim(count=2), devices, []) is None
    assert capacity_for(claim(count=2), devices) == 1
    assert place(claim(), [devices[0]], []) is None


def test_restore_can_be_held_to_its_home_gpu_or_to_the_same_model():
    devices = [Device("GPU-0", 0, "A100"), Device("GPU-1", 1, "H100"), Device("GPU-2", 2, "A100")]
    assert chosen(place(claim(), devices, [], only=["GPU-2"])) == ("GPU-2",)
    assert place(claim(), devices, [holding("a", ["GPU-2"])], only=["GPU-2"]) is None
    leases = [holding("a", ["GPU-0"])]
    assert chosen(place(claim(), devices, leases, same_model_as=[devices[0]])) == ("GPU-2",)
