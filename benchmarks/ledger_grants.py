"""Grants per second through one ledger file, from 1 process and from N processes at once.

A cycle is what a server does for a kernel that computes briefly: claim a GPU and run the
scheduling pass that grants it (one transaction), then release it (a second transaction). Each
process runs cycles back to back for ``--seconds``; the N-process figure is reported against the
1-process figure of the same run, so the ratio says what sharing one file costs on this machine.

By default there are as many simulated GPUs as processes, so a claim never waits for a GPU and
the figure is the ledger's, not the queue's.

    python benchmarks/ledger_grants.py [--seconds 5] [--processes 8] [--devices N] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid

from jupyter_gpusched.core import Device, SchedConfig, new_claim, plan, released
from jupyter_gpusched.ledger import Ledger, OwnerId


def run_cycles(path: str, devices: int, seconds: float, worker: int, start, results) -> None:
    """Run claim/grant/release cycles until ``seconds`` after ``start`` is set."""
    inventory = [Device(uuid=f"GPU-{i}", index=i) for i in range(devices)]
    cfg = SchedConfig()
    me = OwnerId.current()
    ledger = Ledger(path, busy_timeout=60.0)
    latencies: list[float] = []
    grants = waits = 0
    start.wait()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        lease_id, kernel_id = str(uuid.uuid4()), str(uuid.uuid4())
        with ledger.transaction() as tx:
            claim = new_claim(lease_id, kernel_id, f"user-{worker}", tx.now)
            tx.put(claim)
            tx.set_owner(lease_id, kernel_id, f"bench-{worker}", me)
            result = plan(inventory, [*tx.leases(), claim], {}, tx.now, cfg)
            for changed in result.changed:
                tx.put(result.lease(changed))
            granted = result.lease(lease_id).holding
        while not granted:  # only when there are fewer GPUs than processes
            waits += 1
            time.sleep(0.001)
            with ledger.transaction() as tx:
                result = plan(inventory, tx.leases(), {}, tx.now, cfg)
                for changed in result.changed:
                    tx.put(result.lease(changed))
                granted = tx.lease(lease_id).holding
        with ledger.transaction() as tx:
            tx.put(released(tx.lease(lease_id), tx.now, "benchmark cycle done"))
        grants += 1
        latencies.append(time.perf_counter() - began)
    ledger.close()
    results.put({"worker": worker, "grants": grants, "waits": waits, "latencies": latencies, "seconds": seconds})


def measure(processes: int, devices: int, seconds: float, directory: str) -> dict:
    """Run one phase on a fresh ledger file and sum what the workers did."""
    path = os.path.join(directory, f"ledger-{processes}.sqlite")
    Ledger(path).close()
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=run_cycles, args=(path, devices, seconds, n, start, results)) for n in range(processes)
    ]
    for proc in procs:
        proc.start()
    time.sleep(0.5)  # let every worker import and open the ledger before the clock starts
    start.set()
    reports = [results.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"a benchmark worker failed (exit code {proc.exitcode})")
    with Ledger(path) as ledger:
        problems = ledger.check([Device(uuid=f"GPU-{i}", index=i) for i in range(devices)])
        events = sum(1 for ev in ledger.events() if ev.kind == "grant")
    grants = sum(r["grants"] for r in reports)
    latencies = sorted(x for r in reports for x in r["latencies"])
    return {
        "processes": processes,
        "devices": devices,
        "seconds": seconds,
        "grants": grants,
        "grants_per_s": grants / seconds if seconds else 0.0,
        "per_process": [r["grants"] for r in sorted(reports, key=lambda r: r["worker"])],
        "waits": sum(r["waits"] for r in reports),
        "cycle_p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "cycle_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "grant_events": events,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per phase (default 5; two phases)")
    parser.add_argument("--processes", type=int, default=8, help="processes in the shared phase (default 8)")
    parser.add_argument("--devices", type=int, default=0, help="simulated GPUs (default 0: one per process)")
    parser.add_argument("--dir", help="where to put the ledger files (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    devices = args.devices or args.processes

    with tempfile.TemporaryDirectory(prefix="gpusched-bench-") as tmp:
        directory = args.dir or tmp
        os.makedirs(directory, exist_ok=True)
        base = measure(1, devices, args.seconds, directory)
        shared = measure(args.processes, devices, args.seconds, directory)
    ratio = shared["grants_per_s"] / base["grants_per_s"] if base["grants_per_s"] else float("nan")
    nothing = [f"no grant from {row['processes']} process(es)" for row in (base, shared) if not row["grants"]]
    if nothing:
        print(f"measured nothing: {'; '.join(nothing)}", file=sys.stderr)
        return 1

    if args.json:
        print(json.dumps({"one_process": base, "shared": shared, "ratio": ratio}, indent=2))
    else:
        print(f"ledger grants: {devices} simulated GPUs, {args.seconds:g}s per phase, cycle = claim+grant, release")
        heads = ("processes", "grants", "grants/s", "vs 1 proc", "p50 ms", "p99 ms", "waits")
        widths = (9, 7, 9, 9, 7, 7, 6)
        print("  ".join(f"{h:>{w}}" for h, w in zip(heads, widths)))
        for row in (base, shared):
            rel = row["grants_per_s"] / base["grants_per_s"] if base["grants_per_s"] else float("nan")
            print(
                f"{row['processes']:>9}  {row['grants']:>7}  {row['grants_per_s']:>9.1f}  {rel:>8.2f}x  "
                f"{row['cycle_p50_ms']:>7.2f}  {row['cycle_p99_ms']:>7.2f}  {row['waits']:>6}"
            )
        print(f"{args.processes} processes on one file: {ratio:.2f}x the 1-process rate "
              f"(per process: {', '.join(map(str, shared['per_process']))})")
    problems = base["problems"] + shared["problems"]
    for problem in problems:
        print(f"ledger problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
