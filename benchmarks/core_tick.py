"""The cost of one scheduling pass (``core.plan``) as kernels and devices grow.

    python benchmarks/core_tick.py [--kernels 100,300,1000,3000,10000] [--devices 8,64,512]
                                   [--budget 1.0] [--profile KERNELS,DEVICES]

Each case is a host with a realistic mix of leases, one per kernel: about 90 % of the devices are
held (60 % of those leases busy, the rest idle for up to an hour, most past the contended idle
timeout), 5 % of the kernels wait in the queue, and the others are suspended; every lease has a
history of idle spells, users have three kernels each, devices come in NVLink groups of 8 and
claims are for 1 GPU mostly, some for 2, 4 or 8. The table gives the time of one pass (median of
repeats within ``--budget`` seconds) and its ratio to the smallest case of the same run.
``--profile`` prints where one pass of one case spends its time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_gpusched.core import (  # noqa: E402
    Capabilities,
    Device,
    KernelActivity,
    Lease,
    LeaseState,
    SchedConfig,
    plan,
)
from jupyter_gpusched.core.model import GiB  # noqa: E402

NOW = 100_000.0


def host(kernels: int, devices: int, seed: int = 7):
    """Devices, leases and activity of one benchmark case (deterministic for a seed)."""
    rng = random.Random(seed * 1_000_003 + kernels * 1009 + devices)
    devs = [Device(uuid=f"GPU-{i:05d}", index=i, group=f"nvl{i // 8}") for i in range(devices)]
    free = [d.uuid for d in devs]
    leases: list[Lease] = []
    activity: dict[str, KernelActivity] = {}
    pending_left = max(1, kernels // 20)
    target_held = int(devices * 0.9)
    held = 0
    for k in range(kernels):
        kid = f"k{k:06d}"
        user = f"u{k // 3:05d}"
        count = min(rng.choices((1, 2, 4, 8), weights=(80, 10, 7, 3))[0], devices)
        gaps = tuple(round(rng.lognormvariate(5.0, 1.5), 1) for _ in range(rng.randint(0, 32)))
        memory = int(rng.uniform(1, 40) * GiB)
        base = dict(
            id=f"L{k:06d}", kernel_id=kid, user=user, count=count, created_at=NOW - 50_000,
            gaps=gaps, memory_held=memory,
        )
        if held + count <= target_held and len(free) >= count:
            chosen, free[:] = tuple(free[:count]), free[count:]
            held += count
            busy = rng.random() < 0.6
            last = NOW if busy else NOW - rng.uniform(0, 3600)
            state = LeaseState.ACTIVE if busy or NOW - last < 300 else LeaseState.IDLE
            leases.append(
                Lease(**base, state=state, devices=chosen, granted_at=NOW - 40_000, last_active_at=last, busy=busy)
            )
            activity[kid] = KernelActivity(
                kid, busy=busy, last_busy_at=last, gpu_utilization=90.0 if busy else 0.0, gpu_memory=memory
            )
        elif pending_left > 0:
            pending_left -= 1
            queued = NOW - rng.uniform(0, 600)
            leases.append(Lease(**base, state=LeaseState.PENDING, queued_at=queued, last_active_at=queued))
        else:
            home = tuple(rng.sample([d.uuid for d in devs], count))
            last = NOW - rng.uniform(600, 20_000)
            leases.append(Lease(**base, state=LeaseState.SUSPENDED, home=home, last_active_at=last))
            activity[kid] = KernelActivity(kid, busy=False, last_busy_at=last, gpu_utilization=0.0, gpu_memory=memory)
    return devs, leases, activity


CFG = SchedConfig()
CAPS = Capabilities(checkpoint=True, remap=True)


def time_pass(kernels: int, devices: int, budget: float) -> tuple[float, int, int]:
    """Median seconds of one pass, the repeats behind it, and the decisions it makes."""
    devs, leases, activity = host(kernels, devices)
    times = []
    decisions = 0
    spent = 0.0
    while not times or (spent < budget and len(times) < 50):
        started = time.perf_counter()
        result = plan(devs, leases, activity, NOW, CFG, CAPS)
        took = time.perf_counter() - started
        times.append(took)
        spent += took
        decisions = len(result.decisions)
    return statistics.median(times), len(times), decisions


def profile(kernels: int, devices: int) -> None:
    import cProfile
    import pstats

    devs, leases, activity = host(kernels, devices)
    profiler = cProfile.Profile()
    profiler.enable()
    plan(devs, leases, activity, NOW, CFG, CAPS)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(18)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="100,300,1000,3000,10000")
    parser.add_argument("--devices", default="8,64,512")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per case")
    parser.add_argument("--profile", metavar="KERNELS,DEVICES", help="profile one pass of one case instead")
    args = parser.parse_args(argv)
    if args.profile:
        kernels, devices = (int(x) for x in args.profile.split(","))
        profile(kernels, devices)
        return 0
    kernel_sizes = [int(x) for x in args.kernels.split(",")]
    device_sizes = [int(x) for x in args.devices.split(",")]
    rows = []
    base = None
    for devices in device_sizes:
        for kernels in kernel_sizes:
            seconds, repeats, decisions = time_pass(kernels, devices, args.budget)
            if base is None:
                base = seconds
            rows.append((kernels, devices, seconds, seconds / base, repeats, decisions))
            print(
                f"{kernels:>8} {devices:>8} {seconds * 1000:>12.2f} {seconds / base:>9.1f}x {repeats:>8} {decisions:>10}",
                file=sys.stderr,
            )
    print(f"{'kernels':>8} {'devices':>8} {'ms per pass':>12} {'vs first':>10} {'repeats':>8} {'decisions':>10}")
    for kernels, devices, seconds, ratio, repeats, decisions in rows:
        print(f"{kernels:>8} {devices:>8} {seconds * 1000:>12.2f} {ratio:>9.1f}x {repeats:>8} {decisions:>10}")
    # A pass that decides nothing times a scheduler with nothing to do: the host stopped being one.
    if not rows or not any(decisions for *_, decisions in rows):
        why = "no case was timed" if not rows else "no pass made a decision"
        print(f"measured nothing: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
