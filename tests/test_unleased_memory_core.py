"""Memory held outside every lease counts as taken for new claims (issue 21, item 2).

A kernel that gave its lease back and kept its memory, or a job started outside Jupyter, leaves a
GPU free by the leases' books but not in fact: a claim goes there only if it fits beside it.
"""

from __future__ import annotations

from dataclasses import replace

from jupyter_gpusched.core import SHARED, Device, GiB, LeaseState
from jupyter_gpusched.core.placement import STRAY_SLACK, place

from test_core_placement import claim, holding
from test_core_scheduler import Host


def four(used_on_2=0):
    return [Device(f"GPU-{i}", i, "H100", 80 * GiB, memory_used=used_on_2 if i == 2 else 0) for i in range(4)]


def test_a_whole_gpu_exclusive_claim_waits_rather_than_join_someones_memory():
    # GPUs 0, 1 and 3 are held; GPU 2 has no lease but a kernel that released keeps 8 GiB there.
    host = Host(four(used_on_2=8 * GiB))
    for lid, user in (("a", "ann"), ("b", "ben"), ("d", "dan")):
        host.claim(lid, user)
    host.tick(0)
    assert sorted(host[lid].devices[0] for lid in "abd") == ["GPU-0", "GPU-1", "GPU-3"]

    host.claim("n", "nia")
    host.tick(1)
    assert host["n"].state == LeaseState.PENDING
    assert host["n"].reason.startswith(
        "waiting for a GPU: processes outside any lease hold 8.0 GiB on GPU 2, and a claim for the "
        "whole GPU does not fit beside that"
    )

    # The kernel frees its memory: the claim gets GPU 2 at the next pass.
    host.devices = four(used_on_2=0)
    host.tick(2)
    assert host["n"].state == LeaseState.ACTIVE and host["n"].devices == ("GPU-2",)


def test_an_exclusive_claim_for_a_size_goes_where_it_fits_beside_that_memory():
    devices = [Device("GPU-0", 0, memory_total=80 * GiB, memory_used=8 * GiB)]
    assert place(claim(memory=72 * GiB), devices, [])[0] == ("GPU-0",)
    assert place(claim(memory=73 * GiB), devices, []) is None
    assert place(claim(), devices, []) is None


def test_a_free_gpu_is_preferred_to_one_with_memory_outside_any_lease():
    devices = [
        Device("GPU-0", 0, memory_used=8 * GiB),
        Device("GPU-1", 1, memory_used=0),
    ]
    assert place(claim(memory=16 * GiB), devices, [])[0] == ("GPU-1",)
    assert place(claim(), devices, [])[0] == ("GPU-1",)


def test_a_cuda_context_left_behind_does_not_keep_a_whole_gpu_claim_off():
    devices = [Device("GPU-0", 0, memory_used=STRAY_SLACK)]
    assert place(claim(), devices, [])[0] == ("GPU-0",)
    devices = [Device("GPU-0", 0, memory_used=STRAY_SLACK + 1)]
    assert place(claim(), devices, []) is None


def test_a_shared_claim_fits_beside_the_shares_and_the_memory_outside_them():
    # 40 GiB promised to a shared lease whose kernel holds 10 GiB; another 30 GiB held outside
    # any lease: 80 - 40 - 30 = 10 GiB left for a shared claim.
    lease = replace(holding("s", ["GPU-0"], memory=40 * GiB, mode=SHARED), memory_held=10 * GiB)
    devices = [Device("GPU-0", 0, memory_total=80 * GiB, memory_used=40 * GiB)]
    assert place(claim(memory=10 * GiB, mode=SHARED), devices, [lease])[0] == ("GPU-0",)
    assert place(claim(memory=11 * GiB, mode=SHARED), devices, [lease]) is None


def test_a_shared_claim_waits_with_the_reason_when_only_that_memory_keeps_it_off():
    host = Host([Device("GPU-0", 0, "H100", 80 * GiB, memory_used=70 * GiB)])
    host.claim("n", "nia", memory=16 * GiB, mode=SHARED)
    host.tick(0)
    assert host["n"].state == LeaseState.PENDING
    assert "processes outside any lease hold 70.0 GiB on GPU 0, and its 16.0 GiB does not fit beside that" in (
        host["n"].reason
    )
