"""Which node should host a GPU server: the pure choice over the node brokers' summaries.

The Kubernetes spawn hook (:func:`jupyter_gpusched.kubernetes.choose_broker`) and the simulator's
cluster placement (:mod:`jupyter_gpusched.simulate.nodes`) make the very same choice.
"""

from __future__ import annotations

from typing import Mapping

#: The counts every node summary has, and those a newer broker adds (an older one may lack them).
SUMMARY_COUNTS = ("gpus", "free", "reclaimable", "pending", "leases")
NEWER_COUNTS = ("pending_gpus", "servers", "servers_without_lease")


def count_problem(summary: Mapping) -> str | None:
    for key in SUMMARY_COUNTS + NEWER_COUNTS:
        value = summary.get(key)
        if value is None and key in NEWER_COUNTS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"{key} is not a count"
    gpus, free, reclaimable = summary["gpus"], summary["free"], summary["reclaimable"]
    if free + reclaimable > gpus:
        return f"{free} free and {reclaimable} reclaimable GPUs of {gpus}"
    devices = summary.get("devices")
    if isinstance(devices, list) and gpus > len(devices):
        return f"{gpus} GPUs, but {len(devices)} listed"
    return None


def choose_node(summaries: Mapping[str, dict | None], count: int = 1) -> str | None:
    """The node that would serve a claim of ``count`` GPUs best, from the node brokers' summaries.

    Pure. Only nodes whose broker answered and that have at least ``count`` schedulable GPUs
    (``gpus``) are candidates. A node's *room* is its free and reclaimable GPUs (idle or borrowed
    leases the reclaim ladder can take back) less what is already coming for them: the GPUs its
    waiting claims ask for (``pending_gpus``), and one for each connected server that holds no
    lease yet (``servers_without_lease``: kernels bind at their first cell, so a server that
    just started holds nothing but will claim soon). The best is, in this order: a node whose room
    holds the claim; then the fewest servers (as Kubernetes spreads pods that ask for the same);
    the most room; the most free GPUs; and the node name, for ties. None when no broker answered
    or no node has ``count`` GPUs. A broker too old to report ``pending_gpus`` counts one GPU per
    waiting claim, and servers as none. A summary whose counts are not counts, or do not add up
    (more free GPUs than GPUs), is a broken node's and never chosen.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    best: tuple | None = None
    for name, summary in summaries.items():
        if not summary or not isinstance(summary, Mapping) or count_problem(summary):
            continue

        def number(key: str, default: int = 0) -> int:
            value = summary.get(key)
            return default if value is None else int(value)

        gpus, free, reclaimable = number("gpus"), number("free"), number("reclaimable")
        if gpus < count:
            continue
        coming = number("pending_gpus", number("pending")) + number("servers_without_lease")
        room = free + reclaimable - coming
        key = (room < count, number("servers"), -room, -free, name)
        if best is None or key < best:
            best = key
    return None if best is None else best[-1]
