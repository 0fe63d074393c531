"""Prometheus metrics, served on jupyter_server's ``/metrics`` (the default registry)."""

from __future__ import annotations

from collections import Counter as Tally
from typing import Iterable

from prometheus_client import Counter, Gauge, Histogram

from .core import LeaseState
from .core.model import Lease
from .devices.base import DeviceSnapshot

GPUS_HELD = Gauge("gpusched_gpus_held", "GPUs held by a lease right now")
GPUS_FREE = Gauge("gpusched_gpus_free", "Healthy GPUs that no lease holds right now")
LEASES = Gauge("gpusched_leases", "Leases by state", ["state"])
QUEUE = Gauge("gpusched_queue_length", "Claims waiting for a GPU")
WAIT = Histogram(
    "gpusched_wait_seconds",
    "Time a claim waited in the queue before it was granted",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 1800, 3600),
)
RECLAIMS = Counter("gpusched_reclaims_total", "GPUs taken back, by reclaim step", ["step"])


class Metrics:
    """Updates the process-wide metrics from the arbiter's view."""

    def update(self, snapshot: Iterable[DeviceSnapshot], leases: Iterable[Lease], queue: Iterable[str]) -> None:
        leases = list(leases)
        held = {u for lease in leases if lease.holding for u in lease.devices}
        healthy = [d for d in snapshot if d.health == "ok"]
        GPUS_HELD.set(len(held))
        GPUS_FREE.set(sum(1 for d in healthy if d.uuid not in held))
        states = Tally(lease.state.value for lease in leases)
        for state in LeaseState:
            if state != LeaseState.RELEASED:
                LEASES.labels(state=state.value).set(states.get(state.value, 0))
        QUEUE.set(len(list(queue)))

    def waited(self, seconds: float) -> None:
        WAIT.observe(max(0.0, seconds))

    def reclaimed(self, step: str) -> None:
        RECLAIMS.labels(step=step).inc()
