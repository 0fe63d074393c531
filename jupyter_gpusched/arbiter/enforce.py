"""Enforcement (``unleased_processes = 'kill'``): end GPU processes that no lease covers.

Only processes that the inventory lists on a GPU this tick, that belong to this server's Unix
user, and that are not inside the process tree of any live lease's kernel (kernels of other
servers on the same ledger included) are ended, and only when seen so at two ticks in a row (a
kernel may be between its grant and this tick's view). A kernel of this server that uses a GPU it
holds no lease for is told first, in its notebook; its process on that GPU is ended at the next
tick if it is still there.

:func:`suspects` decides (it reads the process table, so it runs off the event loop) and returns
values; :func:`end` carries the decision out.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import psutil

from .. import procs
from ..core import Lease
from ..devices.base import DeviceSnapshot

log = logging.getLogger("jupyter_gpusched")


@dataclass(frozen=True)
class Verdict:
    """What one enforcement pass decided."""

    #: ``outside_lease`` notices for kernels told this pass.
    notices: list[dict] = field(default_factory=list)
    #: (pid, why) to end now: seen outside every lease at two passes in a row.
    due: list[tuple[int, str]] = field(default_factory=list)
    #: The processes seen outside every lease this pass (the next pass ends those still there).
    seen: frozenset[int] = frozenset()


def suspects(
    unleased: Iterable[dict],
    leases: Iterable[Lease],
    owner_pids: Iterable[int],
    trees: Mapping[str, set[int]],
    snapshot: Iterable[DeviceSnapshot],
    seen_before: frozenset[int],
) -> Verdict:
    """Decide which GPU processes to warn about and which to end (see the module's docstring)."""
    unleased = list(unleased)
    foreign = {item["pid"] for item in unleased if not item.get("kernel_id")}
    outside = {item["pid"]: item for item in unleased if item.get("kernel_id")}
    if not foreign and not outside:
        return Verdict()
    protected: set[int] = set()
    leased_kernels = {lease.kernel_id for lease in leases}
    for kernel_id, tree in trees.items():
        if kernel_id in leased_kernels:
            protected |= tree
    owner_pids = list(owner_pids)
    if owner_pids:
        for tree in procs.process_trees(dict(enumerate(owner_pids))).values():
            protected |= tree
    me = os.getpid()
    found = {pid for pid in foreign - protected if pid != me and not procs.descends_from(me, pid)}
    found |= {pid for pid in outside if pid != me}
    due = found & seen_before
    notices = []
    index = {d.uuid: d.index for d in snapshot}
    for pid in sorted(found - due):
        item = outside.get(pid)
        if item is None:
            continue
        gpu = index.get(item["device"], item["device"])
        notices.append(
            {
                "kind": "outside_lease",
                "lease_id": None,
                "kernel_id": item["kernel_id"],
                "user": "",
                "message": (
                    f"Process {pid} of this kernel uses GPU {gpu}, which the kernel holds no lease for: "
                    "it will be ended at the next check (unleased_processes = 'kill'). "
                    "Ask for that GPU with %gpu acquire instead."
                ),
                "reclaim_at": None,
                "state": None,
            }
        )
        log.warning(
            "kernel %s: process %s uses GPU %s outside its lease; told the kernel, ending it at the next check",
            item["kernel_id"], pid, item["device"],
        )
    on_gpu = {item["pid"] for item in unleased}
    kill = [
        (pid, "it uses a GPU outside its kernel's lease" if pid in outside else "it holds GPU memory without a lease")
        for pid in sorted(due)
        if pid in on_gpu
    ]
    return Verdict(notices, kill, frozenset(found))


def end(due: Iterable[tuple[int, str]]) -> None:
    """End each process of this Unix user in ``due`` (SIGTERM)."""
    for pid, why in due:
        try:
            proc = psutil.Process(pid)
            if proc.uids().real != os.getuid():
                continue
            proc.terminate()
        except psutil.Error:
            continue
        log.warning("ended GPU process %s: %s (unleased_processes = 'kill')", pid, why)
