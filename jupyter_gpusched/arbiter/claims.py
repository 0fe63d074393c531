"""A claim written into the ledger: the step between ``LocalArbiter.claim`` and the core's plan.

:func:`write_claims` runs inside the planning transaction (``LocalArbiter._plan_tx``) for the
claims that arrived together; :func:`write_claim`, for each, answers with the kernel's existing
lease where it has one, or admits a new claim (``core.admit``) and writes it, owned by the
kernel's process. The core's :func:`~jupyter_gpusched.core.plan` of the
same transaction then grants it or queues it.
"""

from __future__ import annotations

import logging
import uuid as uuidlib
from dataclasses import dataclass
from typing import Iterable, Mapping

from .. import core
from ..api.input import Claim
from ..api.views import Principal
from ..core import Lease, LeaseState
from ..ledger import OwnerId
from .base import ArbiterError, BadRequest, Conflict, Forbidden, NoInventory

log = logging.getLogger("jupyter_gpusched")


@dataclass(frozen=True)
class ClaimRequest:
    """What a caller asked for (``None``: what the kernel's lease has, or the default)."""

    who: Principal
    ask: Claim
    #: The kernel's process, which will own the lease (None: the server owns it).
    owner_pid: int | None = None
    #: That process's identity where the caller read it already (None: read it from ``owner_pid``).
    owner: OwnerId | None = None
    #: Idle spells of the kernel's earlier lease, so that learning survives a release.
    gaps: tuple[float, ...] = ()


@dataclass(frozen=True)
class Host:
    """What a claim is written against: this arbiter's id, its GPUs' indices, the settings."""

    server_id: str
    device_index: Mapping[str, int]
    cfg: core.SchedConfig


def write_claims(
    requests: list[ClaimRequest], host: Host, tx, leases: list[Lease], devices: Iterable[core.Device]
) -> list[tuple[str, str] | ArbiterError]:
    """Several claims in one transaction (those that arrived together): each one's outcome, or its error.

    A refused claim writes nothing and does not stop the others; each later claim sees the ones
    written before it.
    """
    devices = list(devices)
    out: list[tuple[str, str] | ArbiterError] = []
    for request in requests:
        try:
            how, lease = write_claim(request, host, tx, leases, devices)
        except ArbiterError as exc:
            out.append(exc)
            continue
        except core.ConflictError as exc:
            out.append(Conflict(str(exc)))
            continue
        except core.NoCapacity as exc:
            out.append(NoInventory(str(exc)))
            continue
        except core.SchedulingError as exc:
            out.append(BadRequest(str(exc)))
            continue
        out.append((how, lease.id))
        # What was written, as the ledger now holds it, without reading every lease again.
        leases = [le for le in leases if le.id != lease.id]
        leases.append(lease)
    return out


def write_claim(request: ClaimRequest, host: Host, tx, leases: list[Lease], devices: list[core.Device]) -> tuple[str, Lease]:
    """``(how, lease)``: ``existing``, ``pending`` or ``resume`` for the kernel's lease, or ``new``;
    the lease as written (or as it was, where nothing was written)."""
    ask, who = request.ask, request.who
    mine = [le for le in leases if le.kernel_id == ask.kernel_id and le.live]
    if mine:
        return _existing(who, ask, mine[0], host.device_index, tx)
    claim = core.new_claim(
        uuidlib.uuid4().hex,
        ask.kernel_id,
        who.user,
        tx.now,
        count=1 if ask.count is None else ask.count,
        memory=ask.memory,
        mode=ask.mode or core.EXCLUSIVE,
        priority=ask.priority,
        groups=who.groups,
        gaps=request.gaps,
    )
    core.admit(claim, devices, leases, host.cfg)
    tx.put(claim)
    process = request.owner
    if process is None and request.owner_pid is not None:
        try:
            process = OwnerId.of_pid(request.owner_pid)
        except Exception:  # noqa: BLE001 - fall back to this server owning it
            process = None
    tx.set_owner(claim.id, ask.kernel_id, host.server_id, process)
    log.info(
        "lease %s: kernel %s (%s) asks for %s GPU(s)%s, %s",
        claim.id, ask.kernel_id, who.user, claim.count,
        f" with {core.format_bytes(ask.memory)} each" if ask.memory else "", claim.mode,
    )
    return ("new", claim)


def _existing(who: Principal, ask: Claim, lease: Lease, device_index: Mapping[str, int], tx) -> tuple[str, Lease]:
    if lease.user != who.user and not who.admin:
        raise Forbidden(f"kernel {ask.kernel_id} belongs to another user")
    asked = (ask.count, ask.memory, ask.mode)
    have = (lease.count, lease.memory, lease.mode)
    if any(a is not None and a != h for a, h in zip(asked, have)):
        held = sorted(device_index[u] for u in lease.devices if u in device_index)
        label = (
            f"GPU{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}" if held
            else f"a claim for {lease.count} GPU(s)"
        )
        raise Conflict(
            f"this kernel already holds {label} ({lease.mode}, {lease.state.value}); release it "
            "first (`%gpu release`) to ask for a different one"
        )
    if lease.state == LeaseState.SUSPENDED:
        resumed = core.request_resume(lease, tx.now)
        tx.put(resumed)
        return ("resume", resumed)
    if lease.holding:
        touched = core.touch(lease, tx.now)
        tx.put(touched)
        return ("existing", touched)
    return ("pending", lease)
