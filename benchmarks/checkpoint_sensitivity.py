"""How much checkpoint speed and the host memory budget matter, on the NotebookOS trace.

    python benchmarks/checkpoint_sensitivity.py [--trace PATH] [--gpus 68]
        [--bandwidths 1,2,5,10,25] [--budgets 64,256,1000,unlimited] [--policy hybrid] [--json]

For each per-GPU checkpoint/restore bandwidth (GB/s) and each ``checkpoint_host_memory`` budget
(GB), replays the trace under the policy on ``--gpus`` GPUs with the default fixed cost per
checkpoint and restore, and prints one Markdown table: the policy's capacity (the fewest GPUs
with p95 cell delay <= 5 s and no disruption), GPU-hours held against the oracle's, p95 cell
delay, the worst user's p95, disruptions, checkpoints taken and the most host memory that
checkpoints held at once. It is what the README's sensitivity table shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jupyter_gpusched.core import SchedConfig  # noqa: E402
from jupyter_gpusched.simulate import ReplayOptions, find_capacity, load_trace, simulate  # noqa: E402
from jupyter_gpusched.simulate.capacity import good_enough  # noqa: E402
from jupyter_gpusched.simulate.report import seconds  # noqa: E402

TRACE = "notebookos-adobe-2021-06-01-02.json"


def _trace_path(given: str | None) -> str:
    if given:
        return given
    for folder in (ROOT / "traces", ROOT.parent / "shared" / "traces"):
        if (folder / TRACE).exists():
            return str(folder / TRACE)
    sys.exit(f"{TRACE} not found: give --trace PATH")


def _numbers(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _budgets(text: str) -> list[float | None]:
    return [None if x == "unlimited" else float(x) for x in text.split(",") if x]


def _budget_words(gb: float | None) -> str:
    if gb is None:
        return "unlimited"
    return f"{gb / 1000:g} TB" if gb >= 1000 else f"{gb:g} GB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help=f"trace file (default: {TRACE} in traces/)")
    parser.add_argument("--gpus", type=int, default=68)
    parser.add_argument("--bandwidths", type=_numbers, default=[1, 2, 5, 10, 25], help="GB/s per GPU")
    parser.add_argument("--budgets", type=_budgets, default=[64, 256, 1000, None], help="GB, or 'unlimited'")
    parser.add_argument("--policy", default="hybrid")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    trace = load_trace(_trace_path(args.trace))
    oracle = simulate(trace, "oracle", args.gpus).gpu_hours_held
    rows = []
    for bandwidth in args.bandwidths:
        for budget in args.budgets:
            config = SchedConfig(checkpoint_host_memory=None if budget is None else int(budget * 10**9))
            options = ReplayOptions(config=config, checkpoint_gbps=bandwidth, restore_gbps=bandwidth)
            result = simulate(trace, args.policy, args.gpus, options)
            if not result.passes:
                print(f"measured nothing: {args.policy} replayed no pass at {bandwidth:g} GB/s", file=sys.stderr)
                return 1
            capacity = find_capacity(trace, args.policy, options, known={args.gpus: good_enough(result)})
            rows.append(
                {
                    "bandwidth_gbps": bandwidth,
                    "checkpoint_host_memory_gb": budget,
                    "capacity": capacity,
                    "gpu_hours_held": round(result.gpu_hours_held, 1),
                    "vs_oracle": round(result.gpu_hours_held / oracle, 3),
                    "cell_delay_p95_s": round(result.cell_delay_p95_s, 2),
                    "user_delay_p95_max_s": round(result.user_delay_p95_max_s, 2),
                    "disruptions": result.disruptions,
                    "suspends": result.suspends,
                    "peak_checkpoint_host_gb": round(result.peak_checkpoint_host_gb, 1),
                }
            )
            print(f"  {bandwidth:g} GB/s, {_budget_words(budget)}: done", file=sys.stderr)
    if not rows:
        print("measured nothing: no bandwidth (--bandwidths) or no budget (--budgets)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"gpus": args.gpus, "policy": args.policy, "oracle_gpu_hours": oracle, "rows": rows}, indent=2))
        return 0
    print(f"{args.policy} on {args.gpus} GPUs; the oracle holds {oracle:,.1f} GPU-hours\n")
    print(
        "| GB/s per GPU | host budget | capacity | GPU-h held (x oracle) | p95 delay | worst user's p95 "
        "| disruptions | checkpoints | peak host GB |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        capacity = "none" if row["capacity"] is None else row["capacity"]
        print(
            f"| {row['bandwidth_gbps']:g} | {_budget_words(row['checkpoint_host_memory_gb'])} | {capacity} "
            f"| {row['gpu_hours_held']:,.1f} ({row['vs_oracle']:.2f}x) | {seconds(row['cell_delay_p95_s'], ' ')} "
            f"| {seconds(row['user_delay_p95_max_s'], ' ')} | {row['disruptions']} | {row['suspends']} "
            f"| {row['peak_checkpoint_host_gb']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
