"""How the arbiter tells a pass's decisions: a notice for the lease's viewers and a log line.

A grant says which GPUs (or starts the restore, for a lease coming back from a checkpoint); an
announced reclaim, a reclaim called off, a lease over its memory share and a queued claim each
become a notice with the decision's reason; an idle lease only a debug line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..core import Lease, LeaseState
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
