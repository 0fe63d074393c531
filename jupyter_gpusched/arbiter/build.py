"""One way to build a local arbiter from scheduling configuration: the server's and the broker's."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import SchedulingConfig, open_inventory
from ..core import SchedConfig
from .base import KernelHost
from .local import LocalArbiter
from .policy import AccessPolicy


def build_local_arbiter(
    config: SchedulingConfig,
    *,
    kernels: KernelHost | None,
    log: logging.Logger | logging.LoggerAdapter,
    simulated_state_path: str = "",
    mode: str = "standalone",
    show_holders: bool = True,
    unleased_processes: str = "report",
    policy: AccessPolicy | None = None,
    cfg: SchedConfig | None = None,
) -> tuple[LocalArbiter, str]:
    """Open the inventory and the ledger ``config`` names; returns the arbiter and the simulated state file.

    ``simulated_state_path`` empty: the file next to the ledger (simulated GPUs record there which
    processes use them).
    """
    from ..ledger import Ledger
    from ..metrics import Metrics
    from ..reclaim.checkpoint import detect

    ledger_path = config.resolved_ledger_path()
    os.makedirs(os.path.dirname(ledger_path) or ".", exist_ok=True)
    state_path = simulated_state_path or os.path.join(os.path.dirname(ledger_path), "gpusched-simulated.sqlite")
    backend, note = open_inventory(
        config.backend, config.simulated_devices, state_path, log, allow_shared=config.allow_shared_state_files
    )
    ledger = Ledger(ledger_path, allow_shared=config.allow_shared_state_files)
    metrics: Any = Metrics()
    arbiter = LocalArbiter(
        cfg=cfg or config.sched_config(),
        ledger=ledger,
        backend=backend,
        checkpointer=detect(backend, config.checkpoint),
        kernels=kernels,
        poll_interval=config.poll_interval,
        backend_note=note,
        mode=mode,
        show_holders=show_holders,
        metrics=metrics,
        unleased_processes=unleased_processes,
        policy=policy,
        history_days=config.history_days,
    )
    return arbiter, state_path
