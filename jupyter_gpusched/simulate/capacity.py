"""Capacity planning: the smallest host that serves a trace well under a policy."""

from __future__ import annotations

import math

from .replay import ReplayOptions, Result, simulate
from .trace import Trace

#: A host is good enough when this percentile of cell delays is at most ``MAX_DELAY_S`` ...
QUANTILE = 95.0
MAX_DELAY_S = 5.0
# ... and nobody lost their kernel's state.


def good_enough(result: Result) -> bool:
    return result.cell_delay_p95_s <= MAX_DELAY_S and result.disruptions == 0


def good_for_every_user(result: Result) -> bool:
    """Each user's own p95 is at most ``MAX_DELAY_S``, and nobody lost their kernel's state."""
    return result.disruptions == 0 and all(u.p95_s <= MAX_DELAY_S for u in result.users)


def _late_cells_that_fail(cells: int) -> int:
    """Cells over ``MAX_DELAY_S`` that make the p95 fail whatever the others wait.

    With linear interpolation the p95 lies between the sorted delays at ranks ``floor(r)`` and
    ``floor(r) + 1`` (``r = 0.95 (n - 1)``); once ``n - floor(r)`` cells are late, both are.
    """
    if cells <= 0:
        return 1
    return cells - math.floor((cells - 1) * QUANTILE / 100.0)


def counted_cells(trace: Trace) -> int:
    return sum(len(s.cells) for s in trace.gpu_sessions)


def meets_target(
    trace: Trace,
    policy: str,
    gpus: int,
    options: ReplayOptions | None = None,
    progress: bool | None = None,
    every_user: bool = False,
) -> bool:
    """Whether ``gpus`` GPUs serve ``trace`` under ``policy`` with p95 delay <= 5 s and no disruption
    (``every_user``: each user's own p95 <= 5 s).

    The replay stops as soon as the answer is known to be no.
    """
    if every_user:
        result = simulate(
            trace, policy, gpus, options, abort_on_disruption=True, progress=progress,
            label=f"capacity of {policy} for every user: trying {gpus} GPUs",
        )
        return result is not None and good_for_every_user(result)
    result = simulate(
        trace,
        policy,
        gpus,
        options,
        abort_after_late=_late_cells_that_fail(counted_cells(trace)),
        late_after_s=MAX_DELAY_S,
        abort_on_disruption=True,
        progress=progress,
        label=f"capacity of {policy}: trying {gpus} GPUs",
    )
    return result is not None and good_enough(result)


def find_capacity(
    trace: Trace,
    policy: str,
    options: ReplayOptions | None = None,
    *,
    known: dict[int, bool] | None = None,
    progress: bool | None = None,
    every_user: bool = False,
) -> int | None:
    """The fewest GPUs at which ``policy`` meets the target, or ``None`` if even as many as static
    allocation needs do not. ``every_user``: the target is met by each user's own p95 (known
    verdicts must then be of that target too).

    A bisection between the largest single claim and the static need; it assumes that more GPUs
    never make things worse. ``known`` passes verdicts already at hand (host size -> good enough),
    for example of the run the user asked for, and collects the new ones.

    On a cluster (``options.gpus_per_node``) the search is over whole nodes: the answer is the
    GPUs of the fewest nodes that meet the target, from one node up to those that hold static
    allocation's peak, and, where nodes left part full leave that short, up to twice as many.
    """
    verdicts = known if known is not None else {}
    unit = options.gpus_per_node if options is not None and options.gpus_per_node else 1

    def ok(count: int) -> bool:
        gpus = count * unit
        if gpus not in verdicts:
            verdicts[gpus] = meets_target(trace, policy, gpus, options, progress, every_user)
        return verdicts[gpus]

    need = max(trace.static_peak(), trace.largest_claim())
    high = -(-need // unit)
    low = -(-max(trace.largest_claim(per_cell=policy == "oracle"), 1) // unit)
    if unit > 1:
        # A session's claims stay on its node: the node must hold the largest of them.
        low = max(low, 1)
    # Verdicts at hand narrow the search before any replay runs.
    for gpus, good in verdicts.items():
        if gpus % unit:
            continue
        count = gpus // unit
        if good and low <= count < high:
            high = count
    for gpus, good in verdicts.items():
        if gpus % unit:
            continue
        count = gpus // unit
        if not good and low <= count + 1 <= high:
            low = max(low, count + 1)
    if not trace.gpu_sessions:
        return 0
    if not ok(high):
        if unit == 1 or not ok(2 * high):
            return None
        low, high = high + 1, 2 * high
    while low < high:
        middle = (low + high) // 2
        if ok(middle):
            high = middle
        else:
            low = middle + 1
    return high * unit
