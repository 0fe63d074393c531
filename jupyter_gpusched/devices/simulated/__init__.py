"""Simulated GPUs: the full device interface without a GPU.

The devices come from configuration; who holds what on them lives in a small SQLite file, so that
other processes (kernels, a second server, a test) can use the simulated GPUs much like CUDA::

    # in a kernel started with CUDA_VISIBLE_DEVICES=GPU-... and JUPYTER_GPUSCHED_SIM_STATE=...
    from jupyter_gpusched.devices import simulated
    simulated.allocate("16GiB")      # like torch.empty(...) on cuda:0; OOM past memory_total
    simulated.set_utilization(90)    # "computing"
    simulated.launch(120)            # GPU work in flight for 2 minutes (a checkpoint's lock waits)
    simulated.free()                 # like the process letting go of its context

The backend object also scripts the host for tests: device utilization, lost GPUs, fields the
"driver" does not support, and checkpoint/restore of a process's GPU memory.

One module per concern: :mod:`.config` (which GPUs), :mod:`.state` (the shared state file),
:mod:`.cuda` (the kernel side) and :mod:`.backend` (:class:`SimulatedBackend`).
"""

from __future__ import annotations

from ..base import DeviceLost
from .backend import FIELDS, SimulatedBackend
from .config import (
    DEFAULT_MEMORY,
    DEFAULT_NAME,
    DEFAULT_SEED,
    STATE_ENV,
    STATE_FILE,
    SimulatedDevice,
    default_state_path,
    gpu_uuid,
    mig_uuid,
    parse_devices,
)
from .cuda import allocate, free, launch, memory_allocated, set_utilization, visible_devices
from .state import (
    ALLOW_SHARED_SETTING,
    SimulatedCheckpointUnsupported,
    SimulatedCudaError,
    SimulatedLockTimeout,
    SimulatedOutOfMemory,
    UnsafeStateFile,
)

__all__ = [
    "ALLOW_SHARED_SETTING",
    "DEFAULT_MEMORY",
    "DEFAULT_NAME",
    "DEFAULT_SEED",
    "FIELDS",
    "STATE_ENV",
    "STATE_FILE",
    "DeviceLost",
    "SimulatedBackend",
    "SimulatedCheckpointUnsupported",
    "SimulatedCudaError",
    "SimulatedDevice",
    "SimulatedLockTimeout",
    "SimulatedOutOfMemory",
    "UnsafeStateFile",
    "allocate",
    "default_state_path",
    "free",
    "gpu_uuid",
    "launch",
    "memory_allocated",
    "mig_uuid",
    "parse_devices",
    "set_utilization",
    "visible_devices",
]
