"""Scheduling settings shared by the server extension (``GPUSchedApp``) and the hub broker.

Kept apart from the server so that the broker starts without importing jupyter_server.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from jupyter_core.paths import jupyter_runtime_dir
from traitlets import Bool, Dict, Float, Int, List, TraitError, Unicode, Union, validate
from traitlets.config import Configurable

from . import core
from .core.model import FALLBACKS, POLICIES

from .devices.base import BACKENDS
SCHEDULING_TRAITS = (
    "policy",
    "idle_timeout",
    "contended_idle_timeout",
    "release_timeout",
    "grace_period",
    "reclaim_fallback",
    "checkpoint",
    "idle_utilization_threshold",
    "max_keep",
    "quotas",
    "usage_half_life",
)



#: The share of the host's RAM that checkpoints may hold, unless configured otherwise.
DEFAULT_CHECKPOINT_HOST_MEMORY = "50%"


def host_memory_budget(value: int | str, total: int | None = None) -> int | None:
    """Bytes of ``checkpoint_host_memory``: ``value`` is bytes, a size (``'256GiB'``), a
    percentage of ``total`` (the host's RAM as psutil reports it, where not given) or
    ``'unlimited'`` (None). A TraitError says what is wrong with anything else."""
    name = "checkpoint_host_memory"
    if isinstance(value, str) and value.strip().lower() == "unlimited":
        return None
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            percent = float("nan")
        if not 0 <= percent <= 100:
            raise TraitError(f"{name} as a percentage must be between 0% and 100% of the host's RAM, not {value!r}")
        if total is None:
            import psutil

            total = psutil.virtual_memory().total
        return int(total * percent / 100)
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    try:
        size = core.parse_memory(value, name)
    except core.MissingUnit as err:
        raise TraitError(f"{err}, a percentage of the host's RAM such as '50%', or 'unlimited'") from None
    except core.SchedulingError:
        size = None
    if size is None:
        raise TraitError(
            f"{name} must be a number of bytes, a size such as '256GiB', a percentage of the host's "
            f"RAM such as '50%', or 'unlimited', not {value!r}"
        )
    return size


class _Size(Union):
    """A size trait set from text (the command line) as a size: ``--...=16`` is refused for
    its missing unit instead of being read as 16 bytes. A number in a Python config file is
    bytes, as its help says."""

    def from_string(self, s: str) -> Any:
        text = s.strip()
        if text.isdigit() and int(text) != 0:
            host_memory_budget(text)  # raises, saying what to write
        return super().from_string(s)


def one_of(name: str, choices: Sequence[str]) -> Any:
    """A traitlets validator: ``name`` takes one of ``choices``, else a TraitError that lists them
    (``'a' or 'b'`` for two, ``one of a, b, c`` for more). Assign it in the class body."""
    said = f"{choices[0]!r} or {choices[1]!r}" if len(choices) == 2 else f"one of {', '.join(choices)}"

    def check(self: Any, proposal: Any) -> Any:
        if proposal["value"] not in choices:
            raise TraitError(f"{name} must be {said}, not {proposal['value']!r}")
        return proposal["value"]

    return validate(name)(check)

class SchedulingConfig(Configurable):
    """The scheduling traits shared by ``GPUSchedApp`` and the hub's ``GPUBroker``."""

    backend = Unicode(
        "auto",
        help="""GPU inventory: 'nvml' (NVIDIA driver), 'simulated' (GPUs that exist only in this
        process, for trying things out and for tests), or 'auto': NVML if it loads, else no GPUs
        and a warning. 'auto' never falls back to simulated GPUs.""",
    ).tag(config=True)

    simulated_devices = Union(
        [Int(), List(Dict())],
        default_value=4,
        help="""Simulated GPUs: a number (that many 80 GiB GPUs) or a list of
        {"name", "memory", "mig"} dicts. Used only with backend = 'simulated'.""",
    ).tag(config=True)

    policy = Unicode(
        "hybrid",
        help="""'static' (GPUs bound at kernel start, held until the kernel ends), 'dynamic' (bind
        at the first cell, take idle GPUs back when someone waits) or 'hybrid' (dynamic, with a
        guaranteed share per user from `quotas`).""",
    ).tag(config=True)

    idle_timeout = Float(
        300.0, help="Seconds without execution and GPU use before a lease counts as idle."
    ).tag(config=True)

    contended_idle_timeout = Float(
        60.0, help="Seconds an idle lease above its user's quota is kept while someone waits."
    ).tag(config=True)

    release_timeout = Float(
        3600.0,
        help="""Seconds an idle lease is kept while nobody waits before it is taken back; 0 keeps
        it forever. Gentle steps (release, checkpoint) may come sooner for kernels whose pauses
        are usually long.""",
    ).tag(config=True)

    grace_period = Float(
        60.0, help="Seconds of notice before a reclaim that loses the kernel's state (restart, shutdown)."
    ).tag(config=True)

    reclaim_fallback = Unicode(
        "restart",
        help="""What to do when an idle GPU must be taken back and no gentle step applies:
        'restart' or 'shutdown' the kernel after `grace_period`, or 'none' (never disrupt).""",
    ).tag(config=True)

    checkpoint = Unicode(
        "auto", help="'auto': suspend idle kernels' GPU state with CUDA checkpoints where possible; 'off': never."
    ).tag(config=True)

    idle_utilization_threshold = Float(
        5.0, help="Percent of GPU utilization by a kernel's processes under which it counts as not using the GPU."
    ).tag(config=True)

    max_keep = Float(7200.0, help="Longest `%gpu keep`, in seconds; 0 forbids keeping.").tag(config=True)

    quotas = Dict(
        {},
        help="""Guaranteed GPUs: {"user:alice": 2, "group:students": 1, "*": 1}. Empty: each user is
        guaranteed a fair share of the host (GPUs / users with leases).""",
    ).tag(config=True)

    usage_half_life = Float(
        86400.0,
        help="""Seconds in which a user's (and a group's) recent GPU usage decays by half. Recent
        usage (GPU-seconds held, a shared lease counting its share of the GPU's memory) orders the
        queue after quota, relative to each user's quota, and decides whose borrowed GPU is taken
        back first. Kept in the ledger. 0 turns it off: usage is not tracked.""",
    ).tag(config=True)

    ledger_path = Unicode(
        "",
        help="""SQLite file of the lease ledger; empty: gpusched.sqlite in the Jupyter runtime
        directory. Servers of one Unix user that point at the same file share the GPUs.""",
    ).tag(config=True)

    allow_shared_state_files = Bool(
        False,
        help="""Accept a ledger (`ledger_path`) or simulated GPU state file that another user owns or
        that other users may read or write (group or other permission bits). False: such a file is
        refused at start with a message that says how to make it private; new files are always
        created 0600 and a symbolic link is never followed. Set it only for a file shared on
        purpose, e.g. the simulated state file written by every user's kernels in hub mode: whoever
        can write the ledger can grant themselves GPUs.""",
    ).tag(config=True)

    poll_interval = Float(2.0, help="Seconds between reconcile ticks.").tag(config=True)

    history_days = Float(
        30.0,
        help="""Days a released lease and its history stay in the ledger (`ledger_path`) before they
        are pruned, so that the file stops growing; 0 keeps everything forever. Live leases are
        never pruned, whatever their age.""",
    ).tag(config=True)

    checkpoint_host_memory = _Size(
        [Int(), Unicode()],
        default_value=DEFAULT_CHECKPOINT_HOST_MEMORY,
        help="""Host memory that checkpoints may hold together: a number of bytes, a size such as
        '256GiB', a percentage of the host's RAM such as '50%', or 'unlimited'. A checkpoint moves
        a kernel's GPU memory into host RAM; one that would go over this is not taken, and the
        reclaim ladder goes on to its next step (the lease's reason says so).""",
    ).tag(config=True)

    _valid_backend = one_of("backend", BACKENDS)

    _valid_policy = one_of("policy", POLICIES)

    _valid_fallback = one_of("reclaim_fallback", FALLBACKS)

    _valid_checkpoint = one_of("checkpoint", ("auto", "off"))

    @validate(
        "idle_timeout", "contended_idle_timeout", "release_timeout", "grace_period", "max_keep"
    )
    def _non_negative(self, proposal):
        if proposal["value"] < 0:
            raise TraitError(f"{proposal['trait'].name} must be 0 or more seconds")
        return proposal["value"]

    @validate("usage_half_life")
    def _valid_half_life(self, proposal):
        value = proposal["value"]
        if not value >= 0 or value == float("inf"):
            raise TraitError(f"usage_half_life must be 0 (usage not tracked) or a finite number of seconds, not {value!r}")
        return value

    @validate("history_days")
    def _non_negative_days(self, proposal):
        if proposal["value"] < 0:
            raise TraitError("history_days must be 0 (keep everything) or more days")
        return proposal["value"]

    @validate("poll_interval")
    def _positive_poll(self, proposal):
        if proposal["value"] <= 0:
            raise TraitError("poll_interval must be more than 0 seconds")
        return proposal["value"]

    @validate("idle_utilization_threshold")
    def _percent(self, proposal):
        if not 0 <= proposal["value"] <= 100:
            raise TraitError("idle_utilization_threshold is a percentage between 0 and 100")
        return proposal["value"]

    @validate("quotas")
    def _valid_quotas(self, proposal):
        for key, value in proposal["value"].items():
            if key != "*" and not (key.startswith("user:") or key.startswith("group:")):
                raise TraitError(f"quota key {key!r} must be 'user:NAME', 'group:NAME' or '*'")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise TraitError(f"quota for {key!r} must be a number of GPUs (0 or more)")
        return proposal["value"]

    @validate("checkpoint_host_memory")
    def _valid_host_budget(self, proposal):
        host_memory_budget(proposal["value"], total=1)  # the words only; RAM is read at start
        return proposal["value"]

    def sched_config(self) -> core.SchedConfig:
        return core.SchedConfig(
            checkpoint_host_memory=host_memory_budget(self.checkpoint_host_memory),
            **{name: getattr(self, name) for name in SCHEDULING_TRAITS},
        )

    def resolved_ledger_path(self) -> str:
        return self.ledger_path or os.path.join(jupyter_runtime_dir(), "gpusched.sqlite")


def open_inventory(
    backend: str, simulated_devices: Any, state_path: str | None, log, *, allow_shared: bool = False
) -> tuple[Any, str]:
    """The device backend, or None with a note that says why there are no GPUs.

    ``allow_shared``: the admin's `allow_shared_state_files`, for the simulated state file.
    """
    from .devices.base import InventoryUnavailable, open_backend

    try:
        if backend == "simulated":
            from .devices.simulated import SimulatedBackend

            device_backend = SimulatedBackend(simulated_devices, state_path=state_path, allow_shared=allow_shared)
        else:
            device_backend = open_backend(backend, simulated_devices=simulated_devices, state_path=state_path)
        snap = device_backend.snapshot()
    except InventoryUnavailable as exc:
        if backend == "auto":
            log.warning("GPU scheduler: no GPUs found. %s", exc)
            return None, str(exc)
        raise
    log.info("GPU scheduler: %s backend with %d GPU(s)", device_backend.name, len(snap))
    if device_backend.name == "simulated":
        return device_backend, "simulated GPUs: nothing runs on a real GPU"
    return device_backend, ""
