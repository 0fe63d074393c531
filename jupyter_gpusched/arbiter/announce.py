"""How the arbiter tells a pass's decisions: a notice for the lease's viewers and a log line.

A grant says which GPUs (or starts the restore, for a lease coming back from a checkpoint); an
announced reclaim, a reclaim called off, a lease over its memory share and a queued claim each
become a notice with the decision's reason; an idle lease only a debug line. A release that
leaves GPU memory behind is answered with what is left where (``release_answer``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..core import Lease, LeaseState, format_bytes
from .base import gpus_label, notice

if TYPE_CHECKING:
    from .local import LocalArbiter

log = logging.getLogger("jupyter_gpusched")


def tell(arbiter: LocalArbiter, decision: Any, old: Lease | None, now: float, notices: list) -> None:
    lease = decision.lease
    if decision.kind == "grant":
        waited = now - (old.queued_at if old else lease.queued_at)
        gpus = gpus_label(lease, arbiter.state.snapshot)
        log.info(
            "lease %s of kernel %s (%s) %s %s after %.1fs in the queue (%s)",
            lease.id, lease.kernel_id, lease.user, "restoring onto" if lease.home else "granted",
            gpus, waited, decision.reason,
        )
        if arbiter.metrics is not None:
            arbiter.metrics.waited(waited)
        if lease.home and arbiter.mine(lease):
            arbiter.reclaims.start_restore(lease)
        else:
            notices.append(notice("granted", lease, f"Granted {gpus}"))
    elif decision.kind == "notice":
        log.info(
            "lease %s of kernel %s: reclaim announced for %s: %s",
            lease.id, lease.kernel_id, lease.reclaim_at, decision.reason,
        )
        notices.append(notice("reclaim_warning", lease, decision.reason))
    elif decision.kind == "cancel":
        log.info("lease %s of kernel %s: %s", lease.id, lease.kernel_id, decision.reason)
        notices.append(notice("reclaim_cancelled", lease, decision.reason))
    elif decision.kind == "over_share":
        log.info("lease %s of kernel %s (%s): %s", lease.id, lease.kernel_id, lease.user, decision.reason)
        notices.append(notice("over_share", lease, decision.reason))
    elif decision.kind == "idle":
        log.debug("lease %s of kernel %s: %s", lease.id, lease.kernel_id, decision.reason)
    elif decision.kind == "queue" and (old is None or old.state != LeaseState.PENDING):
        notices.append(queued(lease, decision.position))

def queued(lease: Lease, position: int | None) -> dict:
    item = notice("queued", lease, lease.reason)
    if position is not None:
        item["position"] = position
    log.info(
        "lease %s of kernel %s (%s) queued at position %s: %s",
        lease.id, lease.kernel_id, lease.user, position, lease.reason,
    )
    return item


def release_answer(released: bool, lease: Lease, held: list[dict], rendered: dict) -> dict:
    """The ``DELETE`` answer for a lease whose kernel holds GPU memory (``held``)."""
    total = sum(p["memory_used"] for p in held)
    where = ", ".join(
        f"pid {p['pid']} holds {format_bytes(p['memory_used'])} on GPU {p['index']}" for p in held
    )
    gpus = ", ".join(dict.fromkeys(f"GPU {p['index']}" for p in held))
    if released:
        message = (
            f"Released lease {lease.id}, but kernel {lease.kernel_id}'s processes still hold "
            f"{format_bytes(total)} of GPU memory ({where}). That memory counts as taken on {gpus} "
            "until they free it or the kernel ends: no claim is placed there that does not fit beside it."
        )
    else:
        message = (
            f"Lease {lease.id} is kept: kernel {lease.kernel_id}'s processes hold {format_bytes(total)} "
            f"of GPU memory ({where}), which a release would leave behind on {gpus}. Free that memory and "
            "release again, or release with memory_held=release to leave it behind (it then counts as "
            f"taken on {gpus} until it is freed)."
        )
    return {
        "released": released,
        "lease": rendered,
        "memory_held": total,
        "processes": [
            {"pid": p["pid"], "device": p["device"], "device_index": p["index"], "memory_used": p["memory_used"]}
            for p in held
        ],
        "message": message,
    }
