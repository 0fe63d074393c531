"""Replay the NotebookOS trace under every policy on several host sizes, then find capacities.

    python benchmarks/trace_replay.py [--trace PATH] [--gpus 48,64,96,142] [--json]

Prints one table per host size (the DESIGN section 9 fields, GPU-hours held relative to the
oracle, and the seconds each replay took) and the capacity of each policy: the fewest GPUs with
p95 cell delay <= 5 s and no disruption.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jupyter_gpusched.simulate import POLICIES, find_capacity, load_trace, simulate  # noqa: E402
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
    args = parser.parse_args(argv)
    trace = load_trace(args.trace or default_trace())
    sizes = [int(n) for n in args.gpus.split(",") if n.strip()]

    report: dict = {"trace": Path(trace.source).name, "hosts": {}, "capacity": {}}
    for gpus in sizes:
        results, seconds = {}, {}
        for policy in POLICIES:
            started = time.perf_counter()
            results[policy] = simulate(trace, policy, gpus)
            seconds[policy] = time.perf_counter() - started
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


if __name__ == "__main__":
    sys.exit(main())
