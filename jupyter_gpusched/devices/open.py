"""Opening a backend by name: the one place that knows every backend module.

The backends import :mod:`.base`; this module imports them, each only when asked for, so that
``nvml`` is not loaded (nor the driver touched) on a host that runs simulated GPUs.
"""

from __future__ import annotations

import logging
from typing import Any

from .base import BACKENDS, DeviceBackend, InventoryUnavailable

__all__ = ["open_backend"]

# Named as before open_backend had a module of its own.
log = logging.getLogger("jupyter_gpusched.devices.base")


def open_backend(name: str, simulated_devices: Any = 4, state_path: str | None = None) -> DeviceBackend:
    """Open the backend called ``name``.

    Args:
        name: ``"nvml"``, ``"simulated"`` or ``"auto"``. ``auto`` is NVML when it loads and
            finds a GPU; otherwise it raises, and the caller decides to run without GPUs and
            warn. It never falls back to simulated GPUs on its own: that would hand people
            fake devices without their asking.
        simulated_devices: the simulated backend's devices (an int or a list of dicts).
        state_path: the simulated backend's SQLite state file.

    Raises:
        InventoryUnavailable: NVML cannot be used; the message says what to do.
        ValueError: an unknown backend name or a bad simulated configuration.
    """
    if name == "simulated":
        from .simulated import SimulatedBackend

        return SimulatedBackend(simulated_devices, state_path=state_path)
    if name not in ("nvml", "auto"):
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {name!r}")

    from .nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        count = backend.device_count()
    except InventoryUnavailable as exc:
        backend.close()
        if name == "auto":
            raise InventoryUnavailable(
                f"{exc} Running without GPUs. To try jupyter-gpusched without a GPU, "
                "set c.GPUSchedApp.backend = 'simulated'."
            ) from None
        raise
    if count == 0:
        backend.close()
        raise InventoryUnavailable(
            "The NVIDIA driver loaded but reports no GPU. Check `nvidia-smi -L`, and that the "
            "server's environment can see the devices (container runtime, cgroups)."
        )
    log.info("NVML backend found %s GPU(s)", count)
    return backend
