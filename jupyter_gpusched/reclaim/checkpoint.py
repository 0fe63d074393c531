"""Suspending a kernel's GPU state to host memory and back (DESIGN section 6, step 2).

Three ways, found once at start-up:

* the CUDA driver checkpoint API (``cuCheckpointProcessLock/Checkpoint/Restore/Unlock``, driver
  570 or newer) through ``cuda.bindings.driver`` when that package is installed;
* else the ``cuda-checkpoint`` utility when it is on ``PATH``;
* on simulated GPUs, the simulated backend's own checkpoint.

The process keeps running on the CPU throughout: only its GPU memory and contexts move. UVM and IPC
memory cannot be checkpointed; the driver then refuses and the ladder falls through.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import shutil
import subprocess
from typing import Iterator, Mapping

log = logging.getLogger(__name__)

#: The driver release that brought the checkpoint API (CUDA 12.8).
MIN_DRIVER_API = 12080
#: How long the driver may wait for in-flight GPU work before a lock gives up (milliseconds).
LOCK_TIMEOUT_MS = 30_000


class CheckpointError(RuntimeError):
    """A checkpoint or restore was refused or failed; the message says why."""


class RestoreNoRoom(CheckpointError):
    """A restore found too little free memory on a target GPU; the process stays checkpointed
    and can be restored once there is room (the simulated backend rolls such a restore back).
    On a real driver (580) a process whose restore ran out of memory may refuse every later
    restore (NVIDIA/cuda-checkpoint#44): the next try then fails with a plain CheckpointError,
    which is why the server restores only where the checkpoint fits with a margin."""


#: CUresult of a driver call that ran out of device memory.
CUDA_ERROR_OUT_OF_MEMORY = 2


@contextlib.contextmanager
def _as_checkpoint_error(what: str) -> Iterator[None]:
    """Any exception but a CheckpointError leaves as one, saying what was being done: a
    checkpointer's callers handle CheckpointError alone."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpointer fails only with CheckpointError
        raise CheckpointError(f"{what}: {type(exc).__name__}: {exc}") from exc


class Checkpointer:
    """Suspends and restores one process's GPU state."""

    available: bool = False
    reason: str = "no checkpoint support"
    remap: bool = False

    def checkpoint(self, pid: int) -> int | None:  # pragma: no cover - interface
        """Move ``pid``'s GPU state to host memory; return bytes moved where known."""
        raise CheckpointError(self.reason)

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:  # pragma: no cover
        """Bring ``pid``'s GPU state back, onto other devices if ``device_map`` says so."""
        raise CheckpointError(self.reason)


class Unavailable(Checkpointer):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class SimulatedCheckpointer(Checkpointer):
    """Checkpoint on the simulated backend: the process's simulated memory moves to the host."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.available, self.reason = backend.checkpoint_support()
        self.remap = True

    def checkpoint(self, pid: int) -> int | None:
        return self.backend.checkpoint(pid)

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        from ..devices.simulated import SimulatedOutOfMemory

        with _as_checkpoint_error(f"restore of process {pid}"):
            try:
                self.backend.restore(pid, dict(device_map) if device_map else None)
            except SimulatedOutOfMemory as exc:
                # As the driver answers CUDA_ERROR_OUT_OF_MEMORY; the simulated restore is all or
                # nothing, so the process is still checkpointed.
                raise RestoreNoRoom(f"restore of process {pid}: {exc}") from exc


class DriverCheckpointer(Checkpointer):
    """The CUDA driver checkpoint API through ``cuda.bindings.driver``."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.available = True
        self.reason = "CUDA driver checkpoint API (cuda.bindings)"
        self.remap = hasattr(driver, "CUcheckpointGpuPair")

    def _call(self, name: str, *args) -> None:
        with _as_checkpoint_error(f"{name} for process {args[0] if args else '?'}"):
            result = getattr(self.driver, name)(*args)
            err = result[0] if isinstance(result, tuple) else result
            code = int(err)
        if code == CUDA_ERROR_OUT_OF_MEMORY and name == "cuCheckpointProcessRestore":
            raise RestoreNoRoom(f"{name} failed: {err!r}")
        if code != 0:
            raise CheckpointError(f"{name} failed: {err!r}")

    def checkpoint(self, pid: int) -> int | None:
        lock_args = self.driver.CUcheckpointLockArgs()
        lock_args.timeoutMs = LOCK_TIMEOUT_MS
        self._call("cuCheckpointProcessLock", pid, lock_args)
        try:
            self._call("cuCheckpointProcessCheckpoint", pid, None)
        except CheckpointError:
            self._call("cuCheckpointProcessUnlock", pid, None)
            raise
        return None

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        args = None
        # The buffers behind the map's UUIDs: alive until the driver has read them.
        keep: list = []
        if device_map and any(old != new for old, new in device_map.items()):
            if not self.remap:
                raise CheckpointError("this driver cannot restore onto another GPU")
            with _as_checkpoint_error(f"the GPU map for process {pid}"):
                args = self._remap_args(device_map, keep)
        self._call("cuCheckpointProcessRestore", pid, args)
        del keep
        self._call("cuCheckpointProcessUnlock", pid, None)

    def _remap_args(self, device_map: Mapping[str, str], keep: list):
        pairs = []
        for old, new in device_map.items():
            pair = self.driver.CUcheckpointGpuPair()
            pair.oldUuid = _cu_uuid(self.driver, old, keep)
            pair.newUuid = _cu_uuid(self.driver, new, keep)
            pairs.append(pair)
        args = self.driver.CUcheckpointRestoreArgs()
        args.gpuPairs = pairs
        args.gpuPairsCount = len(pairs)
        keep.append(pairs)
        return args


def _cu_uuid(driver, text: str, keep: list):
    """``driver.CUuuid`` of a ``GPU-xxxxxxxx-...`` UUID. Its ``bytes`` cannot be set (cuda-bindings
    13 has no setter): the struct is built over a 16-byte buffer, which ``keep`` holds alive."""
    raw = bytes.fromhex(text.split("-", 1)[1].replace("-", ""))
    if len(raw) != 16:
        raise CheckpointError(f"{text!r} is not a GPU UUID")
    buf = ctypes.create_string_buffer(raw, 16)
    keep.append(buf)
    return driver.CUuuid(ctypes.addressof(buf))


class UtilityCheckpointer(Checkpointer):
    """The ``cuda-checkpoint`` utility."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.available = True
        self.reason = f"cuda-checkpoint utility at {path}"
        self.remap = False

    def _run(self, action: str, pid: int) -> None:
        cmd = [self.path, "--action", action, "--pid", str(pid)]
        if action == "lock":
            cmd += ["--timeout", str(LOCK_TIMEOUT_MS)]
        with _as_checkpoint_error(" ".join(cmd[1:])):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise CheckpointError(f"cuda-checkpoint --action {action} --pid {pid}: {done.stderr.strip()}")

    def checkpoint(self, pid: int) -> int | None:
        self._run("lock", pid)
        try:
            self._run("checkpoint", pid)
        except CheckpointError:
            self._run("unlock", pid)
            raise
        return None

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        if device_map and any(old != new for old, new in device_map.items()):
            raise CheckpointError("cuda-checkpoint cannot restore onto another GPU here")
        self._run("restore", pid)
        self._run("unlock", pid)


def _driver_api() -> tuple[object | None, str]:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None, "cuda.bindings is not installed"
    if not hasattr(driver, "cuCheckpointProcessCheckpoint"):
        return None, "the installed cuda.bindings has no checkpoint API"
    try:
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return None, f"cuInit failed: {err!r}"
        err, version = driver.cuDriverGetVersion()
        if int(err) != 0:
            return None, f"cuDriverGetVersion failed: {err!r}"
    except Exception as exc:  # noqa: BLE001 - the driver library may be missing entirely
        return None, f"the CUDA driver could not be loaded: {exc}"
    if version < MIN_DRIVER_API:
        return None, f"the CUDA driver is too old for checkpoints (API {version}, needs {MIN_DRIVER_API})"
    return driver, ""


def detect(backend, mode: str = "auto") -> Checkpointer:
    """The best available checkpointer for ``backend``, or one that says why there is none."""
    if mode == "off":
        return Unavailable("checkpoint is off in the configuration")
    if backend is None:
        return Unavailable("there is no GPU inventory")
    if getattr(backend, "name", "") == "simulated":
        checkpointer = SimulatedCheckpointer(backend)
        log.info("checkpoint: %s", checkpointer.reason)
        return checkpointer
    driver, why = _driver_api()
    if driver is not None:
        checkpointer: Checkpointer = DriverCheckpointer(driver)
    elif shutil.which("cuda-checkpoint"):
        checkpointer = UtilityCheckpointer(shutil.which("cuda-checkpoint") or "cuda-checkpoint")
    else:
        checkpointer = Unavailable(f"{why}, and cuda-checkpoint is not on PATH")
    log.info("checkpoint: %s", checkpointer.reason)
    return checkpointer
