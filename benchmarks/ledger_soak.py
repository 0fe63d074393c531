"""Does the ledger stay small and fast after many leases? Claim-release cycles with and without retention.

A cycle is what a server does for a kernel that computes briefly: claim a GPU and run the
scheduling pass that grants it (one transaction), then release it (a second one), as
``ledger_grants.py`` does. A few long-lived leases hold GPUs throughout, so that the pass has live
leases to read. The ledger's clock is fake and advances ``--step`` seconds per cycle, so that,
with retention on, leases released more than ``--history-days`` ago age out: every
``--prune-every`` cycles the run calls ``Ledger.prune`` until it returns less than a batch, as the
arbiter's tick does. The same cycles run on a second file with retention off.

At the start (once the retention window has filled, so that both files hold a full window) and at
the end it prints the file size, the cost of one planning read (``Transaction.leases()`` and
``Transaction.owners()``, as the reconcile tick reads them) and of one claim (the claim
transaction, median over the preceding cycles), and the end-to-start ratios. Target: with
retention on, size and claim cost at the end within 1.5x the start.

    python benchmarks/ledger_soak.py [--cycles 100000] [--history-days 1] [--step 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from jupyter_gpusched.core import Device, SchedConfig, new_claim, plan, released
from jupyter_gpusched.ledger import Ledger, OwnerId

#: Idle leases are kept (release_timeout 0) so that the long-lived ones stay live throughout.
CFG = SchedConfig(release_timeout=0.0, reclaim_fallback="none")
START = 1_700_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def file_size(ledger: Ledger) -> int:
    """The database file and its write-ahead log, once the log is folded in."""
    ledger._read(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())
    wal = ledger.path + "-wal"
    return os.path.getsize(ledger.path) + (os.path.getsize(wal) if os.path.exists(wal) else 0)


def read_cost(ledger: Ledger, repeats: int = 50) -> dict[str, float]:
    """Median ms of one planning read, each inside a write transaction as the tick does it."""
    times: dict[str, list[float]] = {"leases": [], "owners": []}
    for _ in range(repeats):
        with ledger.transaction() as tx:
            began = time.perf_counter()
            tx.leases()
            mid = time.perf_counter()
            tx.owners()
            end = time.perf_counter()
        times["leases"].append(mid - began)
        times["owners"].append(end - mid)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def cycle(ledger: Ledger, inventory: list[Device], n: int, me: OwnerId) -> float:
    """One claim (timed) and its release; the seconds the claim transaction took."""
    lease_id, kernel_id = f"lease-{n}", f"kernel-{n}"
    began = time.perf_counter()
    with ledger.transaction() as tx:
        claim = new_claim(lease_id, kernel_id, f"user-{n % 7}", tx.now)
        tx.put(claim)
        tx.set_owner(lease_id, kernel_id, "soak", me)
        result = plan(inventory, [*tx.leases(), claim], {}, tx.now, CFG)
        for changed in result.changed:
            tx.put(result.lease(changed))
        if not result.lease(lease_id).holding:
            raise SystemExit(f"cycle {n}: the claim was not granted ({result.lease(lease_id).reason})")
    took = time.perf_counter() - began
    with ledger.transaction() as tx:
        tx.put(released(tx.lease(lease_id), tx.now, "soak cycle done"))
    return took


def soak(path: str, args: argparse.Namespace, retention: bool, samples: list[int]) -> dict:
    clock = FakeClock()
    ledger = Ledger(path, clock=clock)
    inventory = [Device(uuid=f"GPU-{i}", index=i) for i in range(args.live + 1)]
    me = OwnerId.current()
    with ledger.transaction() as tx:  # the long-lived leases
        for k in range(args.live):
            tx.put(new_claim(f"resident-{k}", f"resident-kernel-{k}", f"user-{k % 7}", tx.now))
            tx.set_owner(f"resident-{k}", f"resident-kernel-{k}", "soak", me)
        result = plan(inventory, tx.leases(), {}, tx.now, CFG)
        for changed in result.changed:
            tx.put(result.lease(changed))
    history = args.history_days * 86400.0
    claims: list[float] = []
    points: list[dict] = []
    pruned = prune_s = 0.0
    wall = time.perf_counter()
    for n in range(1, args.cycles + 1):
        clock.now += args.step
        claims.append(cycle(ledger, inventory, n, me))
        if retention and n % args.prune_every == 0:
            began = time.perf_counter()
            while (done := ledger.prune(clock.now - history, args.batch)) == args.batch:
                pruned += done
            pruned += done
            prune_s += time.perf_counter() - began
        if n in samples:
            window = claims[-args.window:]
            points.append({
                "cycle": n,
                "size_bytes": file_size(ledger),
                "leases_rows": len(ledger.leases(live_only=False)),
                "events_rows": ledger._read(lambda c: c.execute("SELECT count(*) FROM events").fetchone()[0]),
                "claim_ms": 1000 * statistics.median(window),
                **{f"read_{k}_ms": v for k, v in read_cost(ledger).items()},
            })
    problems = ledger.check(inventory)
    ledger.close()
    return {
        "retention": retention,
        "cycles": args.cycles,
        "pruned": int(pruned),
        "prune_s": prune_s,
        "wall_s": time.perf_counter() - wall,
        "points": points,
        "problems": problems,
    }


def ratios(run: dict) -> dict[str, float]:
    first, last = run["points"][0], run["points"][-1]
    keys = ("size_bytes", "claim_ms", "read_leases_ms", "read_owners_ms")
    return {k: last[k] / first[k] if first[k] else float("nan") for k in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=100_000, help="claim-release cycles per run (default 100000)")
    parser.add_argument("--history-days", type=float, default=1.0, help="retention window (default 1 day)")
    parser.add_argument("--step", type=float, default=60.0, help="fake seconds per cycle (default 60)")
    parser.add_argument("--prune-every", type=int, default=100, help="cycles between prunes (default 100)")
    parser.add_argument("--batch", type=int, default=500, help="leases per prune transaction (default 500)")
    parser.add_argument("--live", type=int, default=8, help="long-lived leases holding GPUs (default 8)")
    parser.add_argument("--window", type=int, default=500, help="cycles whose median claim cost a sample is")
    parser.add_argument("--only", choices=("on", "off"), help="run only retention on, or off")
    parser.add_argument("--dir", help="where to put the ledger files (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)

    window_cycles = int(args.history_days * 86400 / args.step)
    # Start once a full window of history is in the file (retention has begun to prune).
    start = min(args.cycles, max(window_cycles + args.prune_every, args.cycles // 20, args.window))
    samples = sorted({start, *(start + (args.cycles - start) * i // 4 for i in range(1, 5))})
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpusched-soak-") as tmp:
        directory = args.dir or tmp
        os.makedirs(directory, exist_ok=True)
        for retention in (True, False):
            if args.only and args.only != ("on" if retention else "off"):
                continue
            path = os.path.join(directory, f"ledger-{'on' if retention else 'off'}.sqlite")
            for stale in (path, path + "-wal", path + "-shm"):
                if os.path.exists(stale):
                    os.remove(stale)
            runs.append(soak(path, args, retention, set(samples)))
    nothing = [f"retention {'on' if run['retention'] else 'off'} took no sample" for run in runs if not run["points"]]
    if not runs or nothing:
        print(f"measured nothing: {'; '.join(nothing) or 'no run'}", file=sys.stderr)
        return 1

    if args.json:
        print(json.dumps({"runs": [{**r, "ratios": ratios(r)} for r in runs], "window_cycles": window_cycles}, indent=2))
    else:
        print(f"ledger soak: {args.cycles} claim-release cycles, {args.live} long-lived leases, fake clock "
              f"{args.step:g}s per cycle; retention {args.history_days:g} days (= {window_cycles} cycles), "
              f"pruned every {args.prune_every} cycles in batches of {args.batch}")
        heads = ("retention", "cycle", "size MiB", "leases", "events", "claim ms", "leases() ms", "owners() ms")
        widths = (9, 7, 9, 7, 8, 9, 11, 11)
        print("  ".join(f"{h:>{w}}" for h, w in zip(heads, widths)))
        for run in runs:
            for p in run["points"]:
                print(
                    f"{'on' if run['retention'] else 'off':>9}  {p['cycle']:>7}  {p['size_bytes'] / 2**20:>9.2f}  "
                    f"{p['leases_rows']:>7}  {p['events_rows']:>8}  {p['claim_ms']:>9.3f}  "
                    f"{p['read_leases_ms']:>11.3f}  {p['read_owners_ms']:>11.3f}"
                )
        for run in runs:
            r = ratios(run)
            print(
                f"retention {'on ' if run['retention'] else 'off'}: end/start size {r['size_bytes']:.2f}x, "
                f"claim {r['claim_ms']:.2f}x, leases() {r['read_leases_ms']:.2f}x, owners() {r['read_owners_ms']:.2f}x; "
                f"{run['wall_s']:.0f}s, pruned {run['pruned']} leases in {run['prune_s']:.1f}s"
            )
    problems = [p for run in runs for p in run["problems"]]
    for problem in problems:
        print(f"ledger problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
