"""The arbiter: the one interface the REST API, the provisioner and the websockets use.

- ``base``: the :class:`Arbiter` interface, its errors, results and events, and the
  :class:`KernelHost` protocol (every member an arbiter uses of the kernels it schedules).
- ``local``: :class:`LocalArbiter`, the scheduler in this process: a reconcile tick observes
  (``observe``), plans in one ledger transaction (the core decides; ``claims`` writes a claim)
  and applies the plan; reclaim steps go to ``reclaim/executor.py``; ``enforce`` ends unleased
  GPU processes where configured.
- ``policy``: who may do what (a single server's rules, and the hub's).
- ``remote``: :class:`BrokerClient`, the same interface over the hub broker's REST API.
- ``build``: one way to build a local arbiter from scheduling configuration.
"""

from .base import (
    MAX_WAIT,
    Arbiter,
    ArbiterError,
    ArbiterEvent,
    BadRequest,
    ClaimResult,
    Conflict,
    Forbidden,
    KernelHost,
    LedgerUnavailable,
    NoInventory,
    NotFound,
)
from .local import LocalArbiter
from .policy import AccessPolicy, HubPolicy

__all__ = [
    "MAX_WAIT",
    "AccessPolicy",
    "Arbiter",
    "ArbiterError",
    "ArbiterEvent",
    "BadRequest",
    "ClaimResult",
    "Conflict",
    "Forbidden",
    "HubPolicy",
    "KernelHost",
    "LedgerUnavailable",
    "LocalArbiter",
    "NoInventory",
    "NotFound",
]
