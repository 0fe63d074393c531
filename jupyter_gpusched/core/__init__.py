"""Pure scheduling: model, policies, placement, fair queue, idle detection and the reclaim ladder.

Nothing in this package does I/O or reads a clock: time and snapshots come in, decisions with a
human-readable reason come out. The server, the hub broker and the simulator run it unchanged.
"""

from .lifecycle import (
    admit,
    called_off,
    device_lost,
    keep,
    new_claim,
    released,
    request_resume,
    step_done,
    step_failed,
    step_skipped,
    suspended,
    touch,
)
from .model import (
    EXCLUSIVE,
    SHARED,
    Capabilities,
    ConflictError,
    Decision,
    Device,
    GiB,
    Health,
    KernelActivity,
    Lease,
    LeaseState,
    NoCapacity,
    Plan,
    SchedConfig,
    SchedulingError,
    Step,
)
from .scheduler import plan
from .units import MissingUnit, format_bytes, format_duration, parse_duration, parse_memory

__all__ = [
    "EXCLUSIVE",
    "SHARED",
    "Capabilities",
    "ConflictError",
    "Decision",
    "Device",
    "GiB",
    "Health",
    "KernelActivity",
    "Lease",
    "LeaseState",
    "MissingUnit",
    "NoCapacity",
    "Plan",
    "SchedConfig",
    "SchedulingError",
    "Step",
    "admit",
    "called_off",
    "device_lost",
    "format_bytes",
    "format_duration",
    "keep",
    "new_claim",
    "parse_duration",
    "parse_memory",
    "plan",
    "released",
    "request_resume",
    "step_done",
    "step_failed",
    "step_skipped",
    "suspended",
    "touch",
]
