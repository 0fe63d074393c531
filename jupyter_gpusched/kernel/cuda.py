"""What the kernel process knows about CUDA: whether it is initialized, and framework caches.

``CUDA_VISIBLE_DEVICES`` is read once, when the CUDA driver initializes in a process; after that,
changing it changes nothing for this process. The agent therefore asks :func:`probe` before it
binds a lease, and says so plainly when it is too late. Nothing here initializes CUDA or imports a
framework that the user has not imported already.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

#: ``CUDA_ERROR_NOT_INITIALIZED``: what the driver answers before ``cuInit``.
_CUDA_ERROR_NOT_INITIALIZED = 3


@dataclass(frozen=True)
class CudaState:
    """Whether CUDA is initialized in this process.

    ``loaded`` says the driver library is mapped at all (a framework imported it); ``how`` names
    the evidence, for messages and logs.
    """

    initialized: bool
    loaded: bool = False
    how: str = ""


def libcuda_path(maps: str = "/proc/self/maps") -> str | None:
    """The path of the CUDA driver library mapped into this process, if any."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if os.path.basename(path).startswith("libcuda.so"):
                        return path
    except OSError:
        return None
    return None


def _driver_initialized(path: str) -> bool | None:
    """Ask the already loaded driver whether ``cuInit`` ran, without initializing it.

    ``cuCtxGetCurrent`` answers ``CUDA_ERROR_NOT_INITIALIZED`` before ``cuInit``. ``None`` when
    the driver cannot be asked.
    """
    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        fn = lib.cuCtxGetCurrent
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    fn.restype = ctypes.c_int
    ctx = ctypes.c_void_p()
    return fn(ctypes.byref(ctx)) != _CUDA_ERROR_NOT_INITIALIZED


def probe() -> CudaState:
    """Whether CUDA is initialized in this process (torch's own flag, else the driver's)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return CudaState(True, True, "torch.cuda is initialized")
        except Exception:  # noqa: BLE001 - a half-imported or CPU-only torch says nothing useful
            pass
    path = libcuda_path()
    if path is None:
        return CudaState(False, False, "the CUDA driver library is not loaded")
    initialized = _driver_initialized(path)
    if initialized is None:
        # Loaded but cannot be asked: assume the worst rather than promise a binding that the
        # driver will ignore.
        return CudaState(True, True, f"{os.path.basename(path)} is loaded")
    if initialized:
        return CudaState(True, True, f"cuInit has run ({os.path.basename(path)})")
    return CudaState(False, True, f"{os.path.basename(path)} is loaded but cuInit has not run")


def free_framework_caches() -> list[str]:
    """Give cached GPU memory back to the driver in the frameworks this process imported.

    Returns the names of the frameworks whose caches were dropped.
    """
    freed: list[str] = []
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
                freed.append("torch")
        except Exception:  # noqa: BLE001 - best effort: the next step of the ladder follows
            pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
            freed.append("cupy")
        except Exception:  # noqa: BLE001 - best effort, as above
            pass
    return freed
