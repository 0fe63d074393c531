"""Replay the NotebookOS trace under every policy on several host sizes, then find capacities.

    python benchmarks/trace_replay.py [--trace PATH] [--gpus 48,64,96,142] [--json]
    python benchmarks/trace_replay.py --sessions 1000,3000,10000,30000 [--policies hybrid,oracle]
                                      [--host 512] [--parallel] [--json]

Prints one table per host size (the DESIGN section 9 fields, GPU-hours held relative to the
oracle, and the seconds each replay took) and the capacity of each policy: the fewest GPUs with
p95 cell delay <= 5 s and no disruption.

With ``--sessions`` it measures how replay cost grows with the trace instead: synthetic traces
of one-cell sessions in the NotebookOS format (1,000 a day, so that the load on the host is the
same at every size: 30,000 sessions are 30 days) replayed on ``--host`` GPUs, one policy after
another in this process: seconds per replay (wall clock and CPU), the ratio of CPU seconds to
those of the smallest trace in the same run, and that ratio over the ratio of sessions (1.0:
linear growth). CPU seconds, because on a shared machine the wall clock also counts the time
other processes had the core. The oracle row checks that its GPU-hours equal the trace's. With
``--parallel`` each trace is also replayed under all the policies at once, one process per core,
as ``jupyter gpusched simulate --policy all`` does: that wall time is what a user waits for
(and the results must be those of the replays one after another).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jupyter_gpusched.simulate import (  # noqa: E402
    POLICIES,
    find_capacity,
    load_trace,
    parse_notebookos,
    simulate,
    simulate_policies,
)
from jupyter_gpusched.simulate.synthetic import one_cell_trace  # noqa: E402
from jupyter_gpusched.simulate.report import table  # noqa: E402

TRACE = "notebookos-adobe-2021-06-01-02.json"


def default_trace() -> Path:
    for folder in (ROOT / "traces", ROOT.parent / "shared" / "traces"):
        if (folder / TRACE).exists():
            return folder / TRACE
    raise SystemExit(f"{TRACE} not found in traces/ or ../shared/traces/; pass --trace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--gpus", default="48,64,96,142", help="comma-separated host sizes")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead")
    parser.add_argument(
        "--sessions", default="", help="comma-separated trace sizes: measure replay cost against sessions instead"
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="with --sessions: the policies to replay")
    parser.add_argument("--host", type=int, default=512, help="with --sessions: GPUs on the simulated host")
    parser.add_argument("--seed", type=int, default=0, help="with --sessions: the synthetic traces' seed")
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="with --sessions: also replay all the policies at once in parallel processes (wall time)",
    )
    args = parser.parse_args(argv)
    if args.sessions:
        return scaling(
            [int(n) for n in args.sessions.split(",") if n.strip()],
            [p.strip() for p in args.policies.split(",") if p.strip()],
            args.host,
            args.seed,
            args.json,
            args.parallel,
        )
    trace = load_trace(args.trace or default_trace())
    sizes = [int(n) for n in args.gpus.split(",") if n.strip()]

    report: dict = {"trace": Path(trace.source).name, "hosts": {}, "capacity": {}}
    if not sizes:
        print("measured nothing: no host size given (--gpus)", file=sys.stderr)
        return 1
    for gpus in sizes:
        results, seconds = {}, {}
        for policy in POLICIES:
            started = time.perf_counter()
            results[policy] = simulate(trace, policy, gpus)
            seconds[policy] = time.perf_counter() - started
        idle = [policy for policy, r in results.items() if not r.passes]
        if idle:
            print(f"measured nothing: {', '.join(idle)} replayed no pass on {gpus} GPUs", file=sys.stderr)
            return 1
        oracle = results["oracle"].gpu_hours_held
        report["hosts"][gpus] = {
            policy: {
                **r.metrics(),
                "held_vs_oracle": round(r.gpu_hours_held / oracle, 3),
                "passes": r.passes,
                "seconds": round(seconds[policy], 3),
            }
            for policy, r in results.items()
        }
        if not args.json:
            print(f"== {gpus} GPUs ==")
            print(table(results))
            extra = "  ".join(
                f"{p}: {r.gpu_hours_held / oracle:.2f}x oracle, {r.passes} passes, {seconds[p]:.2f}s"
                for p, r in results.items()
            )
            print(extra)
            print()

    started = time.perf_counter()
    for policy in POLICIES:
        t0 = time.perf_counter()
        report["capacity"][policy] = {
            "gpus": find_capacity(trace, policy),
            "seconds": round(time.perf_counter() - t0, 3),
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        "== capacity (p95 cell delay <= 5 s, no disruption; static allocation reserves up to "
        f"{trace.static_peak()} GPUs at once) =="
    )
    width = max(len(p) for p in POLICIES)
    for policy, found in report["capacity"].items():
        gpus = "none" if found["gpus"] is None else found["gpus"]
        print(f"{policy.ljust(width)}  {str(gpus).rjust(5)} GPUs   ({found['seconds']:.2f}s to find)")
    print(f"capacity search took {time.perf_counter() - started:.1f}s in all")
    return 0


def scaling(sizes: list[int], policies: list[str], host: int, seed: int, as_json: bool, parallel: bool = False) -> int:
    """CPU seconds per replay against sessions, as ratios to the smallest size measured in this run."""
    if not sizes or not policies:
        print("measured nothing: no trace size (--sessions) or no policy (--policies)", file=sys.stderr)
        return 1
    rows: list[dict] = []
    for sessions in sizes:
        started = time.perf_counter()
        trace = parse_notebookos(one_cell_trace(sessions, seed=seed), source=f"synthetic-{sessions}")
        busy_hours = trace.busy_gpu_seconds() / 3600.0
        row: dict = {
            "sessions": sessions,
            "days": sessions / 1000,
            "static_peak": trace.static_peak(),
            "load_seconds": round(time.perf_counter() - started, 3),
            "seconds": {},
            "cpu_seconds": {},
            "passes": {},
        }
        results = {}
        for policy in policies:
            started, cpu = time.perf_counter(), time.process_time()
            results[policy] = result = simulate(trace, policy, host, progress=False)
            row["cpu_seconds"][policy] = round(time.process_time() - cpu, 3)
            row["seconds"][policy] = round(time.perf_counter() - started, 3)
            row["passes"][policy] = result.passes
            if not result.passes:
                print(f"measured nothing: {policy} replayed no pass of {sessions} sessions", file=sys.stderr)
                return 1
            if policy == "oracle":
                row["oracle_held_equals_busy"] = result.gpu_hours_held == busy_hours
        row["total_seconds"] = round(sum(row["seconds"].values()), 3)
        row["total_cpu_seconds"] = round(sum(row["cpu_seconds"].values()), 3)
        if parallel:
            started = time.perf_counter()
            together = simulate_policies(trace, policies, host, progress=False)
            row["parallel_seconds"] = round(time.perf_counter() - started, 3)
            row["parallel_same_results"] = together == results
        rows.append(row)
        if not as_json:
            times = "  ".join(f"{p} {row['seconds'][p]:6.2f}s" for p in policies)
            line = f"{sessions:>7} sessions ({row['days']:g} days): {times}  all {row['total_seconds']:.1f}s"
            line += f" (CPU {row['total_cpu_seconds']:.1f}s)"
            if parallel:
                same = "same results" if row["parallel_same_results"] else "DIFFERENT RESULTS"
                line += f"; in parallel processes {row['parallel_seconds']:.1f}s ({same})"
            print(line, flush=True)
    base = rows[0]
    for row in rows:
        growth = row["sessions"] / base["sessions"]
        row["ratio"] = {
            p: round(row["cpu_seconds"][p] / base["cpu_seconds"][p], 2) if base["cpu_seconds"][p] else None
            for p in policies
        }
        total = base["total_cpu_seconds"]
        row["ratio"]["all"] = round(row["total_cpu_seconds"] / total, 2) if total else None
        row["ratio_over_linear"] = {p: round(r / growth, 2) if r is not None else None for p, r in row["ratio"].items()}
    if as_json:
        print(json.dumps({"host_gpus": host, "policies": policies, "rows": rows}, indent=2))
        return 0
    print()
    print(
        f"CPU seconds per replay on {host} GPUs, as a ratio to {base['sessions']} sessions "
        "(x sessions ratio in brackets):"
    )
    names = [*policies, "all"]
    width = max(len(p) for p in names)
    print(" " * (width + 2) + "".join(f"{row['sessions']:>16}" for row in rows))
    for policy in names:
        cells = "".join(
            f"{row['ratio'][policy]:>8.2f}x [{row['sessions'] / base['sessions']:>4.0f}]" for row in rows
        )
        print(f"{policy.ljust(width)}  {cells}")
    print("ratio over linear growth (1.0: cost grows exactly as sessions do):")
    for policy in names:
        print(f"{policy.ljust(width)}  " + "".join(f"{row['ratio_over_linear'][policy]:>16.2f}" for row in rows))
    if "oracle" in policies:
        print("oracle GPU-hours equal the trace's: " + ", ".join(
            f"{row['sessions']}: {'yes' if row.get('oracle_held_equals_busy') else 'NO'}" for row in rows
        ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
