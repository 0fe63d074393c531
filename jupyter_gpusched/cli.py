"""The ``jupyter gpusched`` command line (console script ``jupyter-gpusched``).

Each verb is a subcommand: a function in :data:`VERBS` adds its parser, whose ``func`` default
is the function that runs it and returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Callable, Sequence

from ._version import __version__
from .core.model import FALLBACKS, SchedConfig, SchedulingError
from .core.units import parse_duration

PROG = "jupyter gpusched"


# -- argument types ------------------------------------------------------------------------------
def _duration(text: str) -> float:
    try:
        return parse_duration(text, "duration", bare_seconds=True)  # the options say S: seconds
    except SchedulingError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, not {value}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, not {text}")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected more than 0, not {text}")
    return value


def _quota(text: str) -> tuple[str, float]:
    key, sep, value = text.rpartition("=")
    if not sep or not key or not (key == "*" or key.startswith(("user:", "group:"))):
        raise argparse.ArgumentTypeError(f"a quota is 'user:NAME=GPUS', 'group:NAME=GPUS' or '*=GPUS', not {text!r}")
    return key, _non_negative(value)


# -- simulate ------------------------------------------------------------------------------------
_DEFAULTS = {f.name: f.default for f in fields(SchedConfig) if f.name != "quotas"}


def _nodes(text: str) -> tuple[int, int]:
    from .simulate.nodes import parse_nodes

    try:
        return parse_nodes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_simulate(verbs: argparse._SubParsersAction) -> None:
    from .simulate import POLICIES
    from .simulate.nodes import PLACEMENTS
    from .simulate.replay import CHECKPOINT_FIXED_S, CHECKPOINT_GBPS

    parser = verbs.add_parser(
        "simulate",
        help="replay a workload trace through the scheduler on a virtual clock",
        description=(
            "Replay a workload trace (NotebookOS JSON or our CSV) through the real scheduling core "
            "with a virtual clock, next to the oracle and culling baselines, and report GPU-hours "
            "held, cell delays and disruptions per policy. Defaults are those of GPUSchedApp."
        ),
    )
    parser.add_argument("--trace", required=True, metavar="PATH", help="trace file (.json NotebookOS, .csv ours)")
    parser.add_argument(
        "--gpus", type=_positive_int, metavar="N", help="GPUs on the simulated host (default: what static allocation needs)"
    )
    parser.add_argument(
        "--policy", default="all", choices=(*POLICIES, "all"), metavar="P|all",
        help=f"one of {', '.join(POLICIES)}, or all (default)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object keyed by policy")
    parser.add_argument("--plot", metavar="PNG", help="write a PNG of GPUs held over time against GPUs busy")
    parser.add_argument(
        "--find-capacity", action="store_true",
        help="also find per policy the fewest GPUs with p95 cell delay <= 5 s and no disruption "
        "(with --nodes: the fewest nodes of that size)",
    )
    host = parser.add_argument_group("simulated host")
    host.add_argument(
        "--nodes", type=_nodes, metavar="NxG",
        help="a cluster of N nodes of G GPUs, each with its own broker, instead of one pool (e.g. 8x8; "
        "--gpus, if given, must be N*G); a session's kernels use only the GPUs of the node its server "
        "is placed on",
    )
    host.add_argument(
        "--placement", choices=PLACEMENTS, default=None,
        help="with --nodes: how a server is placed: hook (the spawn hook's rule: the node with the most "
        "free, then reclaimable GPUs; default) or spread (Kubernetes' default spreading: the node with "
        "the fewest servers)",
    )
    host.add_argument(
        "--bandwidth", type=_positive, default=None, metavar="GBPS",
        help=f"per-GPU checkpoint and restore bandwidth in GB/s (default {CHECKPOINT_GBPS:g}, from published "
        "cuda-checkpoint measurements; see the README)",
    )
    host.add_argument(
        "--checkpoint-bandwidth", type=_positive, default=None, metavar="GBPS",
        help="per-GPU checkpoint bandwidth in GB/s, if not --bandwidth",
    )
    host.add_argument(
        "--restore-bandwidth", type=_positive, default=None, metavar="GBPS",
        help="per-GPU restore bandwidth in GB/s, if not --bandwidth",
    )
    host.add_argument(
        "--checkpoint-fixed", type=_non_negative, default=CHECKPOINT_FIXED_S, metavar="S",
        help=f"fixed cost of one checkpoint in seconds (default {CHECKPOINT_FIXED_S:g})",
    )
    host.add_argument(
        "--restore-fixed", type=_non_negative, default=CHECKPOINT_FIXED_S, metavar="S",
        help=f"fixed cost of one restore in seconds (default {CHECKPOINT_FIXED_S:g})",
    )
    host.add_argument(
        "--checkpoint-host-memory", type=_non_negative, default=None, metavar="GB",
        help="host memory that checkpoints may hold at once, in GB (default: no limit); a checkpoint "
        "that would go over it is not taken, as with the checkpoint_host_memory trait",
    )
    host.add_argument(
        "--cull-timeout", type=_duration, metavar="S",
        help="idle seconds before the cull baseline culls a kernel (default: --release-timeout; 0 = never)",
    )
    host.add_argument(
        "--return-lead", type=_duration, default=0.0, metavar="S",
        help="seconds between a user's return to a notebook and its next cell: the notebook's signal "
        "restores a suspended kernel then, where a GPU is free (default 0: the trace records no such times)",
    )
    host.add_argument(
        "--tick-seconds", type=float, default=60.0, metavar="S",
        help="seconds per tick of a NotebookOS trace (default 60)",
    )
    knobs = parser.add_argument_group("scheduling (as the GPUSchedApp traits)")
    for name, help_text in (
        ("idle_timeout", "seconds without execution and GPU use before a lease counts idle"),
        ("contended_idle_timeout", "seconds an idle borrowed lease is kept while someone waits"),
        ("release_timeout", "seconds an idle lease is kept with nobody waiting; 0 = forever"),
        ("grace_period", "notice in seconds before a disruptive reclaim"),
        ("backfill_wait", "seconds a blocked claim waits before smaller ones may no longer pass it"),
    ):
        knobs.add_argument(
            "--" + name.replace("_", "-"), type=_duration, default=_DEFAULTS[name], metavar="S",
            help=f"{help_text} (default {_DEFAULTS[name]:g})",
        )
    knobs.add_argument("--reclaim-fallback", choices=FALLBACKS, default=_DEFAULTS["reclaim_fallback"])
    knobs.add_argument(
        "--checkpoint", choices=("auto", "off"), default=_DEFAULTS["checkpoint"],
        help="auto: the simulated driver checkpoints idle kernels; off: never (default auto)",
    )
    knobs.add_argument(
        "--idle-utilization-threshold", type=_non_negative, default=_DEFAULTS["idle_utilization_threshold"],
        metavar="PERCENT", help=f"GPU use below which a kernel counts idle (default {_DEFAULTS['idle_utilization_threshold']:g})",
    )
    knobs.add_argument(
        "--quota", type=_quota, action="append", default=[], metavar="KEY=GPUS",
        help="guaranteed GPUs, e.g. 'user:alice=2', 'group:students=1', '*=1' (repeatable; default: fair share)",
    )
    knobs.add_argument(
        "--no-adaptive", dest="adaptive", action="store_false",
        help="fixed idle timeouts instead of learning each kernel's pauses",
    )
    parser.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from .simulate import (
        POLICIES,
        ReplayOptions,
        SimulationError,
        TraceError,
        find_capacities,
        load_trace,
        simulate_policies,
        verdicts,
    )
    from .simulate.report import PLACEMENT_WORDS, PlotUnavailable, as_json, plot, table, worst_users

    try:
        config = SchedConfig(
            idle_timeout=args.idle_timeout,
            contended_idle_timeout=args.contended_idle_timeout,
            release_timeout=args.release_timeout,
            grace_period=args.grace_period,
            reclaim_fallback=args.reclaim_fallback,
            checkpoint=args.checkpoint,
            idle_utilization_threshold=args.idle_utilization_threshold,
            quotas=dict(args.quota),
            adaptive=args.adaptive,
            backfill_wait=args.backfill_wait,
            checkpoint_host_memory=(
                None if args.checkpoint_host_memory is None else int(args.checkpoint_host_memory * 10**9)
            ),
        )
        if args.placement is not None and args.nodes is None:
            raise SimulationError("--placement places servers on nodes: give --nodes too (e.g. --nodes 8x8)")
        nodes, per_node = args.nodes if args.nodes is not None else (None, None)
        if nodes is not None and args.gpus is not None and args.gpus != nodes * per_node:
            raise SimulationError(
                f"--gpus {args.gpus} and --nodes {nodes}x{per_node} ({nodes * per_node} GPUs) disagree: "
                "give one of them"
            )
        options = ReplayOptions(
            config=config,
            checkpoint_gbps=args.checkpoint_bandwidth or args.bandwidth or ReplayOptions.checkpoint_gbps,
            restore_gbps=args.restore_bandwidth or args.bandwidth or ReplayOptions.restore_gbps,
            checkpoint_fixed_s=args.checkpoint_fixed,
            restore_fixed_s=args.restore_fixed,
            cull_timeout=args.cull_timeout,
            gpus_per_node=per_node,
            placement=args.placement or "hook",
            return_lead=args.return_lead,
        )
        if args.tick_seconds <= 0:
            raise SimulationError("--tick-seconds must be more than 0")
        trace = load_trace(args.trace, tick_seconds=args.tick_seconds)
        if nodes is not None:
            gpus = nodes * per_node
        else:
            gpus = args.gpus if args.gpus is not None else max(trace.static_peak(), 1)
        policies = POLICIES if args.policy == "all" else (args.policy,)
        # Policies replay in parallel processes where the host has the cores.
        results = simulate_policies(trace, policies, gpus, options)
        capacities = every_user = None
        if args.find_capacity:
            capacities = find_capacities(trace, policies, options, known=verdicts(results))
            every_user = find_capacities(
                trace, policies, options, known=verdicts(results, every_user=True), every_user=True
            )
    except (TraceError, SimulationError, SchedulingError) as err:
        return _fail("simulate", str(err))

    if args.json:
        print(json.dumps(as_json(results, capacities, every_user), indent=2))
    else:
        gpu_sessions = trace.gpu_sessions
        cells = sum(len(s.cells) for s in gpu_sessions)
        if nodes is None:
            host = f"host of {gpus} GPUs"
        else:
            rule = PLACEMENT_WORDS[options.placement]
            plural = "s" if nodes != 1 else ""
            host = f"{nodes} node{plural} of {per_node} GPUs ({gpus} in all), each server placed {rule}"
        print(
            f"{_name(trace.source)}: {len(trace.sessions)} sessions ({len(gpu_sessions)} need GPUs, "
            f"{cells} cells counted); {host}; static allocation reserves up to "
            f"{trace.static_peak()} at once"
        )
        print()
        print(table(results, capacities, every_user))
        print()
        print(worst_users(results))
        print("delay: from a cell's start in the trace until it really starts (queue wait plus restore); "
              "worst user p95: the highest of each user's own p95")
        budget = options.config.checkpoint_host_memory
        print("checkpoints GB: the most host memory that checkpoints held at once"
              + (f" (budget {budget / 10**9:g} GB)" if budget is not None else ""))
        if nodes is not None:
            print("per node: the least and the most GPU-hours held on one node, and sessions placed on one node")
        if capacities is not None and nodes is None:
            print("capacity: fewest GPUs with p95 cell delay <= 5 s and no disruption ('none': not even "
                  f"{trace.static_peak()})")
            print("every user: fewest GPUs at which each user's own p95 is <= 5 s, with no disruption")
        elif capacities is not None:
            print(f"capacity: GPUs of the fewest nodes of {per_node} with p95 cell delay <= 5 s and no disruption "
                  f"('none': not even twice the nodes that hold {trace.static_peak()} GPUs)")
    if args.plot:
        # The plot comes last: a missing matplotlib or a bad path must not cost the results above.
        try:
            where = f"{gpus} GPUs" if nodes is None else f"{nodes}x{per_node} GPUs ({options.placement})"
            plot(results, args.plot, title=f"{_name(trace.source)} on {where}")
        except PlotUnavailable as err:
            return _fail("simulate", f"no plot written: {err}", status=1)
        except (OSError, ValueError) as err:  # a folder that is not there, a format it cannot write
            return _fail("simulate", f"no plot written: cannot write {args.plot}: {err}", status=1)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _name(source: str) -> str:
    return source.replace("\\", "/").rsplit("/", 1)[-1] or "trace"


def _fail(verb: str, message: str, status: int = 2) -> int:
    print(f"{PROG} {verb}: error: {message}", file=sys.stderr)
    return status


#: What ``jupyter gpusched broker`` says where JupyterHub is not installed.
NO_HUB = (
    "the broker runs as a JupyterHub service and needs JupyterHub, which is not installed in this "
    "environment: pip install \"jupyter-gpusched[hub]\" (which is pip install jupyterhub and this "
    "package; see the README's JupyterHub section for the setup)"
)


def _broker(argv: list[str]) -> int:
    """Run the hub broker, or say plainly what is missing to run it."""
    helping = any(arg in ("-h", "--help", "--help-all") for arg in argv)
    if not helping:
        try:
            # The broker authenticates every call with the hub; without JupyterHub it cannot start.
            import jupyterhub.services.auth  # noqa: F401
        except ImportError:
            return _fail("broker", NO_HUB)
    try:
        from .hub.broker import main as broker_main
    except ImportError as err:
        if (err.name or "").partition(".")[0] != "jupyterhub":
            raise
        return _fail("broker", NO_HUB)
    return broker_main(argv) or 0


# -- entry point ---------------------------------------------------------------------------------
#: Functions that add one verb's subparser each (``status``, ``release``, ``drain``,
#: ``kernelspec`` and ``broker`` join ``simulate`` here).
def _add_admin(verbs: argparse._SubParsersAction) -> None:
    from .commands import add_verbs

    add_verbs(verbs)


def _add_broker(verbs: argparse._SubParsersAction) -> None:
    parser = verbs.add_parser(
        "broker",
        help="hub mode: the GPU broker, run as a JupyterHub service",
        description="Run the GPU broker (configure with --GPUBroker.<trait>=... or a config file).",
        add_help=False,
    )
    parser.set_defaults(func=lambda args: main(["broker"]))


VERBS: list[Callable[[argparse._SubParsersAction], None]] = [_add_simulate, _add_admin, _add_broker]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Fair, dynamic GPU sharing for Jupyter: command line tools."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    for add in VERBS:
        add(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``jupyter gpusched VERB ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["broker"]:
        # The broker is a traitlets application with its own --GPUBroker.<trait>= options.
        return _broker(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    from .commands import CommandError

    try:
        return func(args)
    except CommandError as err:
        print(f"{PROG} {args.verb if hasattr(args, 'verb') else ''}: {err}".replace("  ", " "), file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
