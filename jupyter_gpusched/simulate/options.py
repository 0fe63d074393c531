"""How a simulated host behaves: checkpoint costs, the culler's timeout, nodes, a user's return.

:class:`ReplayOptions` travels with every replay, beside the scheduling knobs of its ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.model import Capabilities, GiB, SchedConfig
from . import nodes as cluster

GB = 10**9

#: Per-GPU bandwidth of a CUDA checkpoint or restore between GPU and host memory, in GB/s, and the
#: fixed cost of one, in seconds: published cuda-checkpoint measurements (the README cites them)
#: put a restore of a few GB at several seconds and a whole-GPU toggle at about 15 s; each
#: cuda-checkpoint call alone pays about 2.7 s to attach to the driver.
CHECKPOINT_GBPS = 2.0
CHECKPOINT_FIXED_S = 2.7

class SimulationError(ValueError):
    """A replay that cannot be run as asked; the message says what to change."""


@dataclass(frozen=True)
class ReplayOptions:
    """How the simulated host behaves, beside the scheduling knobs in ``config``.

    ``config.policy`` is ignored: each replay sets the policy it runs. ``cull_timeout`` ``None``
    means ``config.release_timeout`` (0: never cull). ``gpus_per_node``: the host is a cluster
    of nodes of that many GPUs each (the GPUs a replay is given, divided among them), and
    ``placement`` the rule that places each session's server on one (:mod:`.nodes`); ``None``:
    one pool of GPUs.
    """

    config: SchedConfig = field(default_factory=SchedConfig)
    checkpoint_gbps: float = CHECKPOINT_GBPS
    restore_gbps: float = CHECKPOINT_GBPS
    checkpoint_fixed_s: float = CHECKPOINT_FIXED_S
    restore_fixed_s: float = CHECKPOINT_FIXED_S
    cull_timeout: float | None = None
    capabilities: Capabilities = Capabilities(
        checkpoint=True, checkpoint_reason="the simulated driver can checkpoint", remap=True
    )
    device_memory: int = 80 * GiB
    gpus_per_node: int | None = None
    placement: str = "hook"
    #: Seconds between a user's return to a notebook (focus, a cell edited) and its next cell
    #: running: the notebook's signal starts the restore of a suspended lease then, where a GPU is
    #: free and nobody waits (0: no signal; the trace records no such times).
    return_lead: float = 0.0

    def __post_init__(self) -> None:
        if self.checkpoint_gbps <= 0 or self.restore_gbps <= 0:
            raise SimulationError("bandwidth must be more than 0 GB/s")
        if self.checkpoint_fixed_s < 0 or self.restore_fixed_s < 0:
            raise SimulationError("the fixed cost of a checkpoint or restore must be 0 or more seconds")
        if self.cull_timeout is not None and self.cull_timeout < 0:
            raise SimulationError("cull timeout must be 0 or more seconds")
        if self.return_lead < 0:
            raise SimulationError("the return lead must be 0 or more seconds")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise SimulationError("a node must have at least 1 GPU")
        if self.placement not in cluster.PLACEMENTS:
            raise SimulationError(
                f"placement must be one of {', '.join(cluster.PLACEMENTS)}, not {self.placement!r}"
            )

    def checkpoint_seconds(self, memory: int | None, gpus: int = 1) -> float:
        """Time to checkpoint ``memory`` bytes of GPU state spread over ``gpus`` GPUs (each GPU's
        share moves at the per-GPU bandwidth, all GPUs at once)."""
        if not memory:
            return 0.0
        return memory / max(gpus, 1) / (self.checkpoint_gbps * GB) + self.checkpoint_fixed_s

    def restore_seconds(self, memory: int | None, gpus: int = 1) -> float:
        """Time to restore ``memory`` bytes of GPU state onto ``gpus`` GPUs."""
        if not memory:
            return 0.0
        return memory / max(gpus, 1) / (self.restore_gbps * GB) + self.restore_fixed_s

    @property
    def effective_cull_timeout(self) -> float:
        return self.config.release_timeout if self.cull_timeout is None else self.cull_timeout
