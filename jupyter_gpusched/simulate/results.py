"""What a replay reports: the metrics per policy, each user's delays, and the timelines."""

from __future__ import annotations

from dataclasses import dataclass

from . import users as user_delays

#: Policies the simulator replays: the core's three and two baselines.
POLICIES = ("static", "dynamic", "hybrid", "oracle", "cull")
#: What a replay reports per policy, in order (the README's simulator table).
METRICS = (
    "gpu_hours_held",
    "gpu_hours_busy",
    "efficiency",
    "cell_delay_p50_s",
    "cell_delay_p95_s",
    "cell_delay_p99_s",
    "disruptions",
    "suspends",
    "restores",
    "peak_gpus_held",
    "peak_checkpoint_host_gb",
    "user_delay_p95_max_s",
)

@dataclass(frozen=True)
class Result:
    """The outcome of one replay: the metrics plus the timelines behind them."""

    policy: str
    gpus: int
    gpu_hours_held: float
    gpu_hours_busy: float
    efficiency: float | None
    cell_delay_p50_s: float
    cell_delay_p95_s: float
    cell_delay_p99_s: float
    disruptions: int
    suspends: int
    restores: int
    peak_gpus_held: int
    #: The most host memory that checkpoints held at once, in GB (10**9 bytes).
    peak_checkpoint_host_gb: float = 0.0
    #: The worst user's p95 cell delay: each user's cells apart, the highest of their p95s.
    user_delay_p95_max_s: float = 0.0
    #: Each user's cells apart (simulate/users.py): count, p95, GPUs at once, why late cells waited.
    users: tuple[user_delays.UserDelays, ...] = ()
    #: ``(time, GPUs held from then on)`` at every change.
    held: tuple[tuple[float, int], ...] = ()
    #: ``(time, GPUs busy from then on)`` at every change.
    busy: tuple[tuple[float, int], ...] = ()
    #: Delay of every counted cell, in trace order per session.
    delays: tuple[float, ...] = ()
    #: Scheduling passes run.
    passes: int = 0
    #: On a cluster of nodes (``ReplayOptions.gpus_per_node``): its shape, the placement rule,
    #: and per node the GPU-hours held and the sessions placed there.
    nodes: int = 1
    gpus_per_node: int | None = None
    placement: str | None = None
    node_gpu_hours_held: tuple[float, ...] = ()
    node_sessions: tuple[int, ...] = ()

    def metrics(self) -> dict[str, float | int | None]:
        """The ``METRICS`` fields, rounded for people (hours to 1/1000, seconds to 1/100)."""
        out: dict[str, float | int | None] = {}
        for name in METRICS:
            value = getattr(self, name)
            if isinstance(value, float):
                value = round(value, 2 if name.endswith("_s") else 4 if name == "efficiency" else 3)
            out[name] = value
        return out
