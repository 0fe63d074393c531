"""GPU inventory backends: NVML for real GPUs, a simulated one for hosts without.

Backends are opened with :func:`open_backend`; ``nvml`` is imported only when asked for, and it
does not touch the driver before its first snapshot.
"""

from .base import (
    BACKENDS,
    DeviceBackend,
    DeviceLost,
    DeviceSnapshot,
    GPUProcess,
    InventoryUnavailable,
)
from .open import open_backend

__all__ = [
    "BACKENDS",
    "DeviceBackend",
    "DeviceLost",
    "DeviceSnapshot",
    "GPUProcess",
    "InventoryUnavailable",
    "open_backend",
]
