"""A cluster of nodes: which node a session's server is placed on, and what each node's broker says.

With ``--nodes NxG`` the simulated cluster has N nodes of G GPUs, each scheduled by its own broker
(its own scheduling pass over its own GPUs and leases, as the node brokers of a Kubernetes
deployment are). A session's server is placed on one node when it starts, and its kernel's
leases only ever use that node's GPUs. Two placement rules:

* ``hook``: the spawn hook's rule (:func:`jupyter_gpusched.kubernetes.choose_node`, the very
  function the KubeSpawner hook calls) on every node broker's summary at that moment: a node whose
  room (free and reclaimable GPUs less what its waiting claims ask for and one per server without
  a lease) holds the session's claim, then the fewest servers, the most room, the most free GPUs,
  the node's name.
* ``spread``: what Kubernetes does without the hook, for pods that request no GPUs (the brokers
  own the GPUs) and the same CPU and memory each: the least requested node, that is the one with
  the fewest servers running, ties taken in turn after the node chosen last.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..core.forecast import gpu_states
from ..core.model import Capabilities, Device, Lease, LeaseState, SchedConfig

PLACEMENTS = ("hook", "spread")


def parse_nodes(text: str) -> tuple[int, int]:
    """``"8x8"`` as (nodes, GPUs per node); ``ValueError`` with a sentence otherwise."""
    count, sep, per_node = text.strip().lower().partition("x")
    try:
        nodes, gpus = int(count), int(per_node)
    except ValueError:
        nodes = gpus = 0
    if not sep or nodes < 1 or gpus < 1:
        raise ValueError(f"{text!r} is not NODESxGPUS, for example 8x8 (8 nodes of 8 GPUs)")
    return nodes, gpus


def node_names(count: int) -> list[str]:
    """``node-0`` ... with the numbers padded, so that names sort as the nodes are numbered."""
    width = len(str(max(count - 1, 0)))
    return [f"node-{i:0{width}d}" for i in range(count)]


def summary(
    devices: Sequence[Device],
    leases: Iterable[Lease],
    now: float,
    cfg: SchedConfig,
    caps: Capabilities,
    servers: Iterable[str] = (),
) -> dict[str, int]:
    """The counts of a node broker's summary that the spawn hook reads (``GET api/gpusched/node``).

    The same rules as the broker's: a GPU is *free* when it can be scheduled and no lease holds
    it, *reclaimable* when every lease on it can be taken back for another user's claim (an idle
    lease the idle forecast says someone waiting takes, or a lease already being reclaimed);
    ``pending`` counts the claims waiting and ``pending_gpus`` the GPUs they ask for; ``servers``
    are the kernels of the sessions running on the node (one server each), and
    ``servers_without_lease`` those of them without a live lease.
    """
    live = [lease for lease in leases if lease.live]
    states, _ = gpu_states(devices, live, now, cfg, caps)
    waiting = [lease for lease in live if lease.state == LeaseState.PENDING]
    leased = {lease.kernel_id for lease in live}
    servers = list(servers)
    return {
        "gpus": sum(1 for state in states.values() if state != "unavailable"),
        "free": sum(1 for state in states.values() if state == "free"),
        "reclaimable": sum(1 for state in states.values() if state == "reclaimable"),
        "pending": len(waiting),
        "pending_gpus": sum(lease.count for lease in waiting),
        "leases": sum(1 for lease in live if lease.holding),
        "servers": len(servers),
        "servers_without_lease": sum(1 for kernel_id in servers if kernel_id not in leased),
    }


def spread(servers: Sequence[int], last: int) -> int:
    """The node with the fewest servers running; among equals the first after ``last`` in turn."""
    count = len(servers)
    return min(range(count), key=lambda i: (servers[i], (i - last - 1) % count))


__all__ = ["PLACEMENTS", "node_names", "parse_nodes", "spread", "summary"]
