"""Trace replay on the real scheduling core with a virtual clock (capacity planning, benchmarks).

``jupyter gpusched simulate`` is the command line; :func:`simulate` runs one policy on one host
size, :func:`find_capacity` searches the smallest host that serves a trace well.
"""

from .capacity import find_capacity, meets_target
from .parallel import find_capacities, simulate_policies, verdicts
from .replay import METRICS, POLICIES, ReplayOptions, Result, SimulationError, percentile, simulate
from .trace import Cell, Session, Trace, TraceError, load_trace, parse_csv, parse_notebookos

__all__ = [
    "METRICS",
    "POLICIES",
    "Cell",
    "ReplayOptions",
    "Result",
    "Session",
    "SimulationError",
    "Trace",
    "TraceError",
    "find_capacities",
    "find_capacity",
    "load_trace",
    "meets_target",
    "parse_csv",
    "parse_notebookos",
    "percentile",
    "simulate",
    "simulate_policies",
    "verdicts",
]
