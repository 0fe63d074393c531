"""Which simulated GPUs there are: parsing ``simulated_devices`` into devices with stable UUIDs."""

from __future__ import annotations

import dataclasses
import os
import re
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ...core.model import GiB
from ...core.units import format_bytes, parse_memory

__all__ = [
    "DEFAULT_MEMORY",
    "DEFAULT_NAME",
    "DEFAULT_SEED",
    "STATE_ENV",
    "STATE_FILE",
    "SimulatedDevice",
    "default_state_path",
    "gpu_uuid",
    "mig_uuid",
    "parse_devices",
]

#: The state file a kernel process finds its simulated GPUs in.
STATE_ENV = "JUPYTER_GPUSCHED_SIM_STATE"
STATE_FILE = "gpusched-sim.sqlite"

#: Says what it is: nothing here is a real GPU. The model ("H100") still drives architecture
#: detection and "same model" restores.
DEFAULT_NAME = "Simulated H100 80GB"
DEFAULT_MEMORY = 80 * GiB
#: Host-independent, so that every process with the same configuration agrees on the UUIDs.
DEFAULT_SEED = "jupyter-gpusched"
_NAMESPACE = uuidlib.uuid5(uuidlib.NAMESPACE_OID, "jupyter-gpusched.simulated")

_ENTRY_KEYS = {"name", "memory", "mig", "nvlink_group", "architecture", "numa_node"}
_MIG_PROFILE = re.compile(r"^(\d)g\.(\d+)gb(\+me)?$")
#: A GPU has seven compute slices to share among its MIG instances.
_MIG_SLICES = 7
_ARCH_BY_NAME = (
    (re.compile(r"\b(G?B[123]00)\b"), "Blackwell"),
    (re.compile(r"\b(G?H[12]00|H800|H20)\b"), "Hopper"),
    (re.compile(r"\b(L40S?|L4|L20|RTX \d+ Ada)\b"), "Ada"),
    (re.compile(r"\b(A100|A800|A40|A30|A16|A10|A2|RTX A\d+)\b"), "Ampere"),
    (re.compile(r"\b(T4|RTX [68]000)\b"), "Turing"),
    (re.compile(r"\b(V100|TITAN V)\b"), "Volta"),
    (re.compile(r"\b(P100|P40|P4)\b"), "Pascal"),
)


@dataclass(frozen=True)
class SimulatedDevice:
    """One configured simulated GPU or MIG instance."""

    uuid: str
    index: int
    name: str
    memory_total: int
    architecture: str | None = None
    numa_node: int | None = None
    nvlink_group: str | None = None
    parent_uuid: str | None = None
    mig_profile: str | None = None


def gpu_uuid(index: int, seed: str = DEFAULT_SEED) -> str:
    """The UUID of simulated GPU ``index``: the same on every host for the same seed."""
    return f"GPU-{uuidlib.uuid5(_NAMESPACE, f'{seed}/gpu/{index}')}"


def mig_uuid(index: int, slot: int, seed: str = DEFAULT_SEED) -> str:
    """The UUID of MIG instance ``slot`` of simulated GPU ``index``."""
    return f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{seed}/gpu/{index}/mig/{slot}')}"


def _architecture(name: str) -> str | None:
    for pattern, arch in _ARCH_BY_NAME:
        if pattern.search(name):
            return arch
    return None


def parse_devices(config: Any, seed: str = DEFAULT_SEED) -> tuple[SimulatedDevice, ...]:
    """The simulated devices described by ``config``.

    Args:
        config: an int N (N GPUs like an 80 GB H100) or a list of dicts with ``name``,
            ``memory`` (bytes or "80GiB"), and optionally ``mig`` (profiles such as
            ``["3g.40gb", "4g.40gb"]``), ``nvlink_group``, ``architecture``, ``numa_node``.
        seed: makes the UUIDs; the same seed and index always give the same UUID.

    Raises:
        ValueError: the configuration is not one of those shapes; the message says what is off.
    """
    if isinstance(config, str) and config.strip().isdigit():
        config = int(config)
    if isinstance(config, bool):
        raise ValueError("simulated_devices must be a number of GPUs or a list of {name, memory, mig}")
    if isinstance(config, int):
        if config < 0:
            raise ValueError(f"simulated_devices must be 0 or more GPUs, not {config}")
        config = [{} for _ in range(config)]
    if not isinstance(config, Sequence) or isinstance(config, str):
        raise ValueError(
            f"simulated_devices must be a number of GPUs or a list of {{name, memory, mig}}, not {config!r}"
        )

    physical: list[SimulatedDevice] = []
    instances: list[SimulatedDevice] = []
    for index, entry in enumerate(config):
        where = f"simulated_devices[{index}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a dict such as {{'name': ..., 'memory': '80GiB'}}, not {entry!r}")
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}; use {sorted(_ENTRY_KEYS)}")
        name = str(entry.get("name") or DEFAULT_NAME)
        memory = parse_memory(entry.get("memory"), f"{where}.memory") or DEFAULT_MEMORY
        numa = entry.get("numa_node")
        if numa is not None and (isinstance(numa, bool) or not isinstance(numa, int) or numa < 0):
            raise ValueError(f"{where}.numa_node must be a NUMA node number, not {numa!r}")
        group = entry.get("nvlink_group")
        device = SimulatedDevice(
            uuid=gpu_uuid(index, seed),
            index=index,
            name=name,
            memory_total=memory,
            architecture=entry.get("architecture") or _architecture(name),
            numa_node=numa,
            nvlink_group=str(group) if group is not None else None,
        )
        physical.append(device)
        instances.extend(_mig_instances(device, entry.get("mig") or (), seed, where))
    count = len(physical)
    return tuple(physical) + tuple(
        dataclasses.replace(inst, index=count + offset) for offset, inst in enumerate(instances)
    )


def _mig_instances(parent: SimulatedDevice, profiles: Any, seed: str, where: str) -> list[SimulatedDevice]:
    if isinstance(profiles, str) or not isinstance(profiles, Sequence):
        raise ValueError(f"{where}.mig must be a list of MIG profiles such as ['3g.40gb', '4g.40gb']")
    slices = memory = 0
    instances = []
    for slot, profile in enumerate(profiles):
        match = _MIG_PROFILE.match(str(profile))
        if not match:
            raise ValueError(f"{where}.mig[{slot}] must be a MIG profile such as '3g.40gb', not {profile!r}")
        size = int(match.group(2)) * GiB
        slices += int(match.group(1))
        memory += size
        instances.append(
            SimulatedDevice(
                uuid=mig_uuid(parent.index, slot, seed),
                index=-1,
                name=f"{parent.name} MIG {profile}",
                memory_total=size,
                architecture=parent.architecture,
                numa_node=parent.numa_node,
                # One CUDA process sees at most one MIG instance: instances form no group.
                nvlink_group=None,
                parent_uuid=parent.uuid,
                mig_profile=str(profile),
            )
        )
    if slices > _MIG_SLICES:
        raise ValueError(f"{where}.mig uses {slices} compute slices; a GPU has {_MIG_SLICES}")
    if memory > parent.memory_total:
        raise ValueError(
            f"{where}.mig needs {format_bytes(memory)}, more than the GPU's {format_bytes(parent.memory_total)}"
        )
    return instances


def default_state_path() -> str:
    """``$JUPYTER_GPUSCHED_SIM_STATE``, else a file in the Jupyter runtime directory."""
    path = os.environ.get(STATE_ENV)
    if path:
        return path
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        directory = jupyter_runtime_dir()
    except ImportError:  # pragma: no cover - jupyter_core comes with jupyter_server
        import tempfile

        directory = os.path.join(tempfile.gettempdir(), f"jupyter-gpusched-{os.getuid()}")
    return os.path.join(directory, STATE_FILE)
